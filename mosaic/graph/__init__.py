from .ctx import Ctx, EagerCtx
from .record import Buffer, RecordCtx, Template, record
from .shard import Shard, chunk_bounds

__all__ = ["Buffer", "Ctx", "EagerCtx", "RecordCtx", "Shard", "Template", "chunk_bounds", "record"]
