"""Reading a run directory: the Store over its Parquet segments, attempts and group instances, the
event pass that derives the per-step tables (local DuckDB or Ray), the persisted summary and the
object-store mirror. The SQL library of named macros is sql/ (one object a file)."""
