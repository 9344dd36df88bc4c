"""Building blocks the model families share: attention over the paged cache, fused/packed linears.
The exit heads sit beside the models in :mod:`hispec_decode.models.exit_heads`."""
