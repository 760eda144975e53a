"""A training project made by scaffold; see: python -m default --help"""
