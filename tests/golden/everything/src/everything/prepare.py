"""The `prepare` command: the data `train --data SOURCE` reads, written as shards with an index
(runtime/shards.py) to a new folder or a URL, from which `train --data DEST` streams it.

    python -m everything prepare --data SOURCE --out s3://bucket/data

--shard-mb sets the size a shard aims at (64 MB by default). What goes into a shard is
data_shards.py's `write_shards(cfg, writer)`; reading one back, its reader's.
"""

from .config import Config, add_config_arguments
from .data_shards import write_shards
from .runtime.shards import ShardWriter

TASK = "custom"


def add_prepare(commands) -> None:
    """The command's parser: --data and the options load_splits reads, --out and --shard-mb."""
    preparer = commands.add_parser("prepare", help="write the data as shards that train --data streams")
    preparer.add_argument("--out", dest="dest", required=True, metavar="DEST", help="a new folder or a URL")
    preparer.add_argument("--shard-mb", type=float, default=64, help="the shards' size in MiB (default: 64)")
    add_config_arguments(preparer)


def prepare(cfg: Config, dest: str, shard_mb: float) -> str:
    """Writes the shards and then the index; returns the line saying what it wrote."""
    with ShardWriter(dest, TASK, shard_mb=shard_mb) as writer:
        write_shards(cfg, writer)
        return writer.close()
