"""``ckptdoctor convert``: torch_dist <-> Megatron-FSDP's fsdp_dtensor (plain DCP), offline on CPU."""
