"""A stand-in for MindSpeed (tests only): its Megatron adaptor and how it reads its options."""
