"""The internal column names of a store's build, chosen so they cannot meet a source column by accident.

One place for the names the compute pass, the reduction, the writer and the executors' tasks share.
"""

from __future__ import annotations

RAW_KEY = "__keyroute_raw_key"  # the key column as its key format reads it (keys.raw_key_column)
ERROR = "__keyroute_key_error"  # why a key does not fit the key format, null when it does
ROWS = "__keyroute_rows"  # source records per key
ORDER = "__keyroute_order"  # latest: the winning order_by
LATEST = "__keyroute_latest"  # latest: the winning row, a struct
ROUTE = "__keyroute_route"  # struct(key, partition, error[, lmdb_key]) of a raw key (keys.route_column)
OFF_PARTITION = "__keyroute_off_partition"  # audited stores: a key with a record outside its partition
# A format-2 store's route also carries each key's LMDB key (keyroute.storage.lmdb_layout.db_key of the very
# bytes its partition was computed from): the writer sorts by it and the executors store it as it is.
LMDB_KEY = "__keyroute_lmdb_key"
# Live stores: the merge state as a JSON object {"0": ..., "1": ...}, in merge order (reduce.live_state).
STATE = "__keyroute_live_state"
TIE = "__keyroute_tie"  # hybrid latest stores: the source offset that breaks ties on order_by
NEWEST = "__keyroute_ttl_newest"  # latest stores with a ttl: the key's greatest order_by (compute.unexpired)
MAX_OFFSET = "__keyroute_max_offset"  # hybrid stores: a key's greatest source offset
NULL_OFFSETS = "__keyroute_null_offsets"  # hybrid stores: a key's records without an offset
STATE_FIELD = "__keyroute_state_{}"  # live aggregate stores: the merge state of aggregate i
KEY_BYTES = "__keyroute_key_bytes"  # the most bytes a key text is long, in the check's summary
TEXT_BYTES = "__keyroute_text_bytes"  # a column of the cached frame: json_size.row_text_bytes
# History and windowed stores whose order_by is read from text: the text as the source spelled it, kept beside
# the parsed time, and the file each row came from (what an error about a value that does not parse names).
ORDER_TEXT = "__keyroute_order_text"
# An ordering column's values as int64s of its type (keyroute.pipeline.ordering), one column per ordering.
ORDER_VALUE = "__keyroute_order_value_{}"
SOURCE_FILE = "__keyroute_source_file"
