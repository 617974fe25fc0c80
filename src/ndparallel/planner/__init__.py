"""``ndparallel plan``: predict memory, bytes and step time of every layout for a model and a cluster, and rank them.

One module per concern: `hardware` (GPU profiles, data), `model` (a Hugging Face config.json), `mixture` and
`experts` (the mixture-of-experts part of a model, expert parallelism's figures), `recipe` (how one step runs),
`layouts` (enumeration and the library's refusals; the sizes themselves are `ndparallel.distributed.layout.Layout`),
`expert_costs` (what experts add per layout), `footprint` (the bytes each rank holds), `offload` (FSDP2's CPU
offload), `comm`, `timing` (the cost model), `search` (the best recipe per layout, the ranking), `longest`
(``--max-seq``), `report` (table, JSON, explanation) and `plot` (``--plot``: the pictures, with matplotlib, imported
there only). docs/planner.md has the formulas.
"""

from .hardware import Hardware, get_hardware
from .layouts import Layout, parse_layout
from .model import ModelSpec, load_model, spec_from_config
from .search import Plan, Request, Row, evaluate, plan, row_for
from .recipe import Recipe

__all__ = ["Hardware", "Layout", "ModelSpec", "Plan", "Request", "Recipe", "Row", "evaluate", "get_hardware",
           "load_model", "parse_layout", "plan", "row_for", "spec_from_config"]
