"""On-disk formats: torch_dist (PyTorch DCP), torch.save zip archives, legacy zarr."""
