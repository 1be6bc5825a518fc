"""The collectives whose names changed between torch releases, under their current names.

torch 2.13 calls them ``all_gather_single`` / ``reduce_scatter_single`` (functional, traceable)
and ``torch.distributed.reduce_scatter_single``; torch 2.4 to 2.12 call the same functions
``all_gather_tensor`` / ``reduce_scatter_tensor`` and ``torch.distributed.reduce_scatter_tensor``
(2.13 keeps those as deprecated aliases that warn). Both take the same arguments.
"""

from __future__ import annotations

import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

all_gather_single = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor
reduce_scatter_single = getattr(funcol, "reduce_scatter_single", None) or funcol.reduce_scatter_tensor
reduce_scatter_single_into = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
wait_tensor = funcol.wait_tensor
