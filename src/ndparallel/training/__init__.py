"""The training loop's pieces: data loaders sharded along the batch (`data`, Accelerate's loader types in
`loader_types`), the loss and its token count (`loss`), the optimizer and scheduler wrappers (`optim`),
gradient clipping (`clip`), `find_executable_batch_size` (`batch_size`), `set_seed` (`seed`), the
record of prepared objects (`prepared`), step time and MFU (`metrics`, `flops`; `run_metrics` for
``plan --measure``), and the no-argument singletons of Accelerate (`singletons`)."""
