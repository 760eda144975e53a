"""Machinery: what the training loop stands on; each file's docstring says what it holds, and the
README's layout lists them. Read it to learn how a run works; your own code is config.py, data.py,
model.py and optim.py above this folder, and the loop in train.py."""
