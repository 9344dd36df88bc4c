"""Built-in chat prompts for the demo and the benchmark, and chat-template rendering."""

from __future__ import annotations

CHAT_PROMPTS = [
    "Write a short story about a robot learning to paint.",
    "Explain how a hash table works, with an example in Python.",
    "What are the main causes of the French Revolution?",
    "Give me three tips for writing a good cover letter.",
    "Write a Python function that checks whether a string is a palindrome.",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do vaccines train the immune system?",
    "Write a haiku about autumn leaves, then explain its imagery.",
    "What is the difference between a list and a tuple in Python?",
    "Plan a three-day trip to Rome for a first-time visitor.",
    "Explain gradient descent to a high-school student.",
    "Write an email asking my manager for a day off next Friday.",
]


def encode_prompt(tokenizer, text: str, chat: bool = True) -> list[int]:
    """Token ids of ``text``, rendered with the tokenizer's chat template when ``chat``."""
    if chat and getattr(tokenizer, "chat_template", None):
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                            tokenize=True, return_dict=False)
        return list(ids)
    return tokenizer(text)["input_ids"]
