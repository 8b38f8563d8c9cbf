"""Small built-in prompt sets per domain for quick benchmarks (not training data)."""

from __future__ import annotations

_CODE_SNIPPET = """def moving_average(values, window):
    result = []
    for i in range(len(values)):
        start = max(0, i - window + 1)
        chunk = values[start:i + 1]
        result.append(sum(chunk) / len(chunk))
    return result
"""
_CLASS_SNIPPET = """class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        return self.items.pop()

    def is_empty(self):
        return len(self.items) == 0
"""

BUILTIN_PROMPTS: dict[str, list[str]] = {
    "code": [
        f"Add type hints and a docstring to this function:\n\n{_CODE_SNIPPET}",
        f"Rewrite this class so that pop() raises a clear error on an empty stack:\n\n{_CLASS_SNIPPET}",
        "Write a Python function that checks whether a number is prime.",
        "Write a Python function that returns the n-th Fibonacci number iteratively.",
        f"Rename the function to rolling_mean and the variable chunk to window_values:\n\n{_CODE_SNIPPET}",
        "Write a Python function that reverses the words in a sentence.",
        f"Add a method peek() to this class:\n\n{_CLASS_SNIPPET}",
        "Write a JavaScript function that removes duplicates from an array.",
    ],
    "chat": [
        "What are three tips for staying focused while studying?",
        "Explain what a rainbow is to a ten-year-old.",
        "Write a short poem about autumn leaves.",
        "What should I pack for a weekend hiking trip?",
        "Give me a simple recipe for pancakes.",
        "Why is the sky blue?",
        "Suggest a name for a friendly robot and explain why.",
        "How do I politely decline an invitation to a party?",
    ],
    "math": [
        "A shop sells pencils at 3 for $1. How much do 27 pencils cost? Explain step by step.",
        "If a train travels 60 miles per hour for 2.5 hours, how far does it go?",
        "What is 15% of 240? Show your work.",
        "Tom has 12 apples and gives a third of them to Anna. How many does he have left?",
        "Solve for x: 3x + 7 = 22.",
        "A rectangle is 8 cm long and 5 cm wide. What are its area and perimeter?",
        "What is the sum of the integers from 1 to 20?",
        "A recipe needs 2 cups of flour for 12 cookies. How much flour for 30 cookies?",
    ],
}
