"""Model building blocks: norm, rotary embedding, attention math, dense MLP, MoE."""
