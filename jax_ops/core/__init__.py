"""The op-declaration framework: implementation registry and `use()` (registry), the
automatic choice (dispatch, with the autotune cache file in cache), partitioning rules
(sharding), the 1-bit mask format (bitmask), declarations -> primitives (op), and
finding/explaining the op calls in a function (calls); the benchmark spec type of the
declarations (benchspec) and the wall-clock timer autotune and the benchmark share
(timing)."""
