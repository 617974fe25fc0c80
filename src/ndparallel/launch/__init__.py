"""The ``ndparallel`` command and the launcher: `cli` (``launch``, ``config``, ``env``, ``merge-weights``),
`plan_commands` (``plan``, ``estimate-memory``), `arguments` (what the commands share), `launcher` (torchrun with
checked sizes, ranks that die with their launcher), `supervision` (the nodes' roll call, the stall watch),
`accelerate_launch` (``accelerate launch``'s flags and config files), `schedulers` (the nodes of a SLURM step or a
Kubernetes PyTorchJob, from their environment), `worker` (run by path in each rank before the
script: the standard library only)."""
