"""Prompts for the default model's end-to-end checks: plain text of varied lengths and
chat conversations (rendered with the model's chat template)."""

from __future__ import annotations

PLAIN = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "1, 2, 3, 4, 5,",
    "The quick brown fox",
    "Water boils at a temperature of",
    "In 1969, the first humans",
    "import numpy as np\nimport torch\n\n\nclass Model(torch.nn.Module):\n    def __init__(self):",
    "Photosynthesis is the process by which green plants and some other organisms use sunlight to "
    "synthesize foods from carbon dioxide and water. Photosynthesis in plants generally involves the "
    "green pigment chlorophyll and generates oxygen as a byproduct. The process",
    "Dear Sir or Madam,\n\nI am writing to",
    ("The history of the printing press begins in the fifteenth century. " * 12) + "In conclusion,",
]

CHAT = [
    "Name three primary colors.",
    "What is 12 times 7?",
    "Write a haiku about the sea.",
    "Explain recursion to a child in two sentences.",
    "Translate 'good morning' into Spanish.",
    "Give me a short list of healthy breakfast ideas.",
    "What is the boiling point of water in Fahrenheit?",
]


def prompt_ids(tokenizer) -> list[list[int]]:
    """Every prompt as token ids: plain texts encoded, chat questions through the template
    (``tokenizer``: pagedserve's or transformers')."""
    plain = [tokenizer.encode(p) for p in PLAIN]
    chat = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        )
        for q in CHAT
    ]
    return plain + chat
