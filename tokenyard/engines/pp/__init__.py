"""Pipeline parallelism: decoder layers split into contiguous stages, one process (or one
tensor-parallel group) per stage, activations sent stage to stage with point-to-point ops."""
