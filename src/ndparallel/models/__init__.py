"""What ndparallel knows about each family of models, as data: `families` (one `Family` entry per
``config.model_type``: its tensor-parallel plan and fused layers, its experts and router, the config fields that give
its shape, what ``ndparallel plan`` models of it). Nothing is imported here: the table imports no torch, so the
planner reads it as it reads `ndparallel.distributed.layout`."""
