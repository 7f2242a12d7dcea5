"""``ckptdoctor convert``: torch_dist to Megatron-FSDP's fsdp_dtensor (plain DCP), offline on CPU."""
