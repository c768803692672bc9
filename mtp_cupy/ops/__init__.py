"""One function per kernel launch: validates sizes, picks grid/block, launches.

This package is the only place that knows launch geometry. Each file matches a cuda_src module; every
public launcher is re-exported here so callers write `ops.linear(gpu, ...)`. See docs/kernels.md."""
from .elementwise import *  # noqa: F401,F403
from .rms_norm import *  # noqa: F401,F403
from .norm_rope import *  # noqa: F401,F403
from .rope import *  # noqa: F401,F403
from .kv_cache import *  # noqa: F401,F403
from .gemv import *  # noqa: F401,F403
from .gemv_wg import *  # noqa: F401,F403
from .paged_attention import *  # noqa: F401,F403
from .argmax import *  # noqa: F401,F403
from .moe import *  # noqa: F401,F403
from .quantize import *  # noqa: F401,F403
from .grouped_gemv import *  # noqa: F401,F403
from .hyper_connection import *  # noqa: F401,F403
from .dsa import *  # noqa: F401,F403
from .vocab_argmax import *  # noqa: F401,F403
from .call_io import *  # noqa: F401,F403
