"""How the engine runs its forwards on a machine: KV caches (``kv_cache``: dynamic and static), forwards through
CUDA graphs per query-size bucket (``graphs``), where a step's time goes (``timeline``), counted device-to-host
reads (``host_reads``) and the measured cost of verification rows (``forward_costs``)."""
