"""Building blocks the model families share: attention over the paged cache, fused/packed linears,
exit heads."""
