"""The building blocks of every model family. Each layer creates its own parameters and
knows how to load them: a checkpoint tensor reaches a parameter through the parameter's
`weight_loader`, which cuts this rank's shard under tensor parallelism. A family file
(pagellm/models) only wires layers together and names its checkpoint's tensors."""
