"""The sample table: schema and validation, sharded parquet I/O, converters, the synthetic corpus."""

from ovkit.data.io import Samples, count_rows, parquet_files, read_samples, read_table
from ovkit.data.parts import (
    REJECTS,
    parse_shard,
    part_name,
    shard_bounds,
    shard_out,
    write_rejects,
    write_samples,
    write_table,
)
from ovkit.data.schema import (
    IMAGE,
    IMAGE_TOKEN,
    MESSAGE,
    OPTIONAL,
    REQUIRED,
    check_columns,
    conform,
    image_cell,
    row_problems,
    samples_table,
)

__all__ = [
    "IMAGE",
    "IMAGE_TOKEN",
    "MESSAGE",
    "OPTIONAL",
    "REJECTS",
    "REQUIRED",
    "Samples",
    "check_columns",
    "conform",
    "count_rows",
    "image_cell",
    "parquet_files",
    "parse_shard",
    "part_name",
    "read_samples",
    "read_table",
    "row_problems",
    "samples_table",
    "shard_bounds",
    "shard_out",
    "write_rejects",
    "write_samples",
    "write_table",
]
