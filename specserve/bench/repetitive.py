"""A repetitive prompt set: "repeat / edit this code", where n-gram drafting should pay.

Built in (no download): a few small Python functions, each paired with an edit request
that makes the answer copy most of the input.
"""
from __future__ import annotations

SNIPPETS = [
    "def mean(values):\n    total = 0\n    for v in values:\n        total += v\n    return total / len(values)\n",
    "def is_prime(n):\n    if n < 2:\n        return False\n    for d in range(2, int(n ** 0.5) + 1):\n"
    "        if n % d == 0:\n            return False\n    return True\n",
    "class Stack:\n    def __init__(self):\n        self.items = []\n\n    def push(self, item):\n"
    "        self.items.append(item)\n\n    def pop(self):\n        return self.items.pop()\n",
    "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            print('FizzBuzz')\n"
    "        elif i % 3 == 0:\n            print('Fizz')\n        elif i % 5 == 0:\n            print('Buzz')\n"
    "        else:\n            print(i)\n",
]
EDITS = [
    "Repeat the following code exactly, without any change:",
    "Rewrite the following code, renaming every variable to a longer descriptive name:",
    "Copy the following code and add a comment above each line:",
]


def repetitive_prompts(n: int | None = None) -> list[str]:
    prompts = [f"{edit}\n\n```python\n{code}```" for code in SNIPPETS for edit in EDITS]
    return prompts[:n]
