"""Tools: what proves and inspects the training code. They build the model and data from your files and run
the loop's own pieces, so a check proves the code that trains."""
