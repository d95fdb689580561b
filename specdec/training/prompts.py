"""The training prompts for draft heads: templated open-ended instructions (explain, story, list, how-to,
compare, advice, poem, dialogue, email, code) over everyday topics.

The target answers them itself (specdec.training.eagle3_data); the head learns from those answers. They
are disjoint from the benchmark's prompts (bench/prompts.py: the open workload is the held-out set the
head's agreement is measured on; tests/test_eagle3_training.py checks that no benchmark prompt is here).
Deterministic order: `training_prompts(n)` takes an even spread of templates and topics.
"""

from __future__ import annotations

TEMPLATES = (
    "Explain how {t} works, in simple terms.",
    "Write a short story in which {t} plays an important part.",
    "Give me a numbered list of five interesting facts about {t}.",
    "How do I get started with {t}? Give step-by-step advice for a beginner.",
    "What are the pros and cons of {t}? Answer in two short paragraphs.",
    "Write a short poem about {t}.",
    "Describe {t} to someone who has never heard of it.",
    "Write a short dialogue between two friends who disagree about {t}.",
    "Write a friendly email to a colleague recommending {t}.",
    "What are three common mistakes people make with {t}, and how can they avoid them?",
    "Summarise the history of {t} in a few sentences.",
    "Why do people care about {t}? Give a thoughtful answer.",
)

TOPICS = (
    "bicycles", "volcanoes", "honey bees", "the water cycle", "solar panels", "chess", "public libraries",
    "sleep", "vaccines", "the moon", "coffee", "recycling", "rainforests", "electric cars", "origami",
    "learning a second language", "compound interest", "the printing press", "thunderstorms", "yoga",
    "gardening on a balcony", "the internet", "penguins", "bread baking", "running a marathon", "museums",
    "photosynthesis", "budgeting", "jazz music", "trains", "camping", "the human heart", "wind turbines",
    "board games", "writing a diary", "earthquakes", "friendship", "time zones", "spreadsheets", "whales",
    "video calls", "tea ceremonies", "mountain hiking", "composting", "the Roman Empire", "batteries",
    "meditation", "kites", "maps", "rain gauges", "sourcing local food", "the periodic table",
)

CODE_TASKS = (
    "Write a Python function that returns the {n} largest numbers in a list, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python function that counts how often each letter appears in a text.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a JavaScript function that removes duplicate items from an array.",
    "Write a SQL query that lists the {n} customers with the most orders.",
)


def training_prompts(n: int | None = None) -> list[str]:
    """Up to n prompts (all of them when None): templates x topics interleaved, then the code tasks."""
    out = []
    for i, topic in enumerate(TOPICS):
        for j in range(len(TEMPLATES)):
            out.append(TEMPLATES[(i + j) % len(TEMPLATES)].format(t=topic))
    # interleave so that a prefix covers every template and many topics
    ordered = [out[i * len(TEMPLATES) + j] for j in range(len(TEMPLATES)) for i in range(len(TOPICS))]
    code = list(dict.fromkeys(task.format(n=k) for k in (3, 5) for task in CODE_TASKS))
    mixed = []
    for i, prompt in enumerate(ordered):
        mixed.append(prompt)
        if i % 10 == 9 and code:
            mixed.append(code.pop(0))
    mixed += code
    return mixed[:n] if n else mixed
