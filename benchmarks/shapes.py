"""The benchmarks' model shapes (megatron ModelConfig fields), in a module of their own so that a command line can
name them without importing torch or megatron-core."""

PRESETS = {
    "1b": dict(
        num_layers=16,
        hidden_size=2048,
        num_attention_heads=16,
        num_query_groups=8,
        ffn_hidden_size=8192,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    # The 8B-class shape of issue 12 (Llama-3-8B-like, vocabulary 32000).
    "8b": dict(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        vocab_size=32000,
        max_position_embeddings=4096,
    ),
    "tiny": dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=128,
        vocab_size=100,
        max_position_embeddings=256,
    ),
}
