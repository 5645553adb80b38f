"""The built-in models: gpt (a pre-LayerNorm GPT) and mlp (a teacher-student MLP)."""
