"""Machinery: what the loop in train.py stands on; each file's docstring says what it holds, as does the
README's layout. Your own code is above this folder: config.py, data.py, model.py and optim.py."""
