"""The distributed runtime: the layout declared once (`layout`: axes, sizes, views by purpose) and the
mesh of its views (`mesh`), the process group and device (`runtime`), ranks that must agree
(`agreement`), failed collectives explained on every rank (`failures`), gathering and reducing over
views (`gather_reduce`), and Accelerate's process state (`state`: `PartialState`,
`AcceleratorState`). Nothing is imported here: `distributed.layout` stays free of torch."""
