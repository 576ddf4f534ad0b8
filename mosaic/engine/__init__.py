"""The engine: MosaicEngine and the objects it composes (engine.py says how they fit)."""

from ..prompts import LengthWarning
from .checks import SpeculationWarning, check_kernels, check_sparse_layers
from .engine import MosaicEngine
from .request import ALIASES, Canvas, Request, Requests
from .result import Generation
from .run import RequestCancelled, RequestRun

__all__ = ["ALIASES", "Canvas", "Generation", "LengthWarning", "MosaicEngine", "Request", "RequestCancelled",
           "RequestRun", "Requests", "SpeculationWarning", "check_kernels", "check_sparse_layers"]
