"""Generate standalone, readable PyTorch training projects from a copier template."""


def __getattr__(name: str) -> str:
    """`__version__`, read when first asked for: `python -m scaffold` imports this module before
    its main() can turn a Ctrl-C into one line, and importlib.metadata takes a while to import."""
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        found = version("scaffold")
    except PackageNotFoundError:  # running from a checkout that was never installed
        found = "0.0.0+unknown"
    globals()["__version__"] = found
    return found
