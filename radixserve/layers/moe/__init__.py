"""Mixture-of-experts layers: the router (top-k selection on the device) and the experts
(FusedMoE: stacked expert weights that load per expert and shard per tensor-parallel rank,
computed by the Triton fused-MoE kernels on the GPU and by a loop over active experts on CPU)."""
