from .ctx import Ctx, EagerCtx, chunk_bounds
from .record import Buffer, RecordCtx, Template, record

__all__ = ["Buffer", "Ctx", "EagerCtx", "RecordCtx", "Template", "chunk_bounds", "record"]
