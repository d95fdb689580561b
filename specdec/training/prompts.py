"""The training prompts for draft heads: templated open-ended instructions (explain, story, list, how-to,
compare, advice, poem, dialogue, email, code) over everyday topics.

The target answers them itself (specdec.training.eagle3_data); the head learns from those answers. They
are disjoint from the benchmark's prompts (bench/prompts.py: the open workload is the held-out set the
head's agreement is measured on; tests/test_eagle3_training.py checks that no benchmark prompt is here).
Deterministic order: `training_prompts(n)` takes the first list's 632 first, each list an even spread of templates
and topics.
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

# The grown list (2026-11-29): more kinds of instruction and more topics, for more training data; each new
# template over every topic and every template over each new topic. Still nothing near the held-out prompts'
# subjects.
MORE_TEMPLATES = (
    "Teach me the basics of {t} as if I were ten years old.",
    "Write a blog post introduction about {t} that makes readers want to keep reading.",
    "What is a common myth about {t}, and what is the truth?",
    "Give me a short quiz of three questions about {t}, with the answers at the end.",
    "Compare {t} today with {t} fifty years ago.",
    "Write a haiku and then a limerick about {t}.",
    "What questions should I ask an expert on {t}? List five and say why each is useful.",
    "Write a diary entry from someone who spent the whole day thinking about {t}.",
    "Explain {t} using an analogy from everyday life.",
    "Write a product description for a book called 'The Secret Life of {t}'.",
    "What would happen if {t} suddenly disappeared from the world? Think it through step by step.",
    "Give a two-minute speech that a teacher could give about {t}.",
    "Write a conversation between a curious child and a grandparent about {t}.",
    "Summarise the most important ideas about {t} in five bullet points.",
    "What are some fun weekend activities related to {t}?",
    "Write a news headline and a short article about a surprising discovery involving {t}.",
    "Describe a typical day for a person whose job involves {t}.",
    "Give me a beginner's glossary of five terms related to {t}, with a one-line definition each.",
    "Write a motivational message for someone who is struggling with {t}.",
    "How has technology changed {t}? Give a balanced answer.",
)

MORE_TOPICS = (
    "owls", "glaciers", "knitting", "chocolate", "volunteering", "sundials",
    "the immune system", "podcasts", "paper money", "octopuses", "hot air balloons", "city parks", "rice farming",
    "the Olympic Games", "birdwatching", "telescopes", "recycling electronics", "street food", "bridges",
    "the Great Wall of China", "ants", "wool", "public speaking", "tides", "snow", "pottery", "cheese making",
    "the alphabet", "airports", "coral reefs", "lemons", "first aid", "mushrooms", "sign language", "canals",
    "deserts", "the violin", "elephants", "skateboarding", "calendars", "soap", "bamboo", "fireflies",
    "the stock market", "ancient Egypt", "submarines", "cloud types", "pencils",
    "dinosaurs", "tomatoes", "hiking boots", "the postal service", "bees in cities", "rainbows", "clocks",
    "chess openings", "fountain pens", "sea turtles", "wildfires", "the metric system", "fermentation",
    "roller coasters", "houseplants", "the Silk Road", "windmills", "mathematics puzzles", "kindness",
    "swimming", "glass making", "the ozone layer", "beavers", "radio", "caves", "jigsaw puzzles", "salt",
    "the Renaissance", "electric guitars", "marathons in history", "lakes", "microscopes", "typewriters",
    "wolves", "spices", "bicycle repair", "the solar system", "satellites", "handwriting", "forests in autumn",
)

CODE_TASKS = (
    "Write a Python function that returns the {n} largest numbers in a list, with a docstring.",
    "Write a Python function that checks whether a string is a palindrome, ignoring case and spaces.",
    "Write a Python function that counts how often each letter appears in a text.",
    "Write a Python class for a simple bank account with deposit and withdraw methods.",
    "Write a JavaScript function that removes duplicate items from an array.",
    "Write a SQL query that lists the {n} customers with the most orders.",
)


def _interleaved(templates, topics) -> list[str]:
    """Every template over every topic, ordered so that a prefix covers every template and many topics."""
    n = len(templates)
    out = [templates[(i + j) % n].format(t=topic) for i, topic in enumerate(topics) for j in range(n)]
    return [out[i * n + j] for j in range(n) for i in range(len(topics))]


def chat_prompts() -> list[str]:
    """The 632 prompts of the first list: templates x topics interleaved, the code tasks among them
    (bench.guidellm_sweep's chat requests, kept as they were so that its runs compare across days)."""
    code = list(dict.fromkeys(task.format(n=k) for k in (3, 5) for task in CODE_TASKS))
    mixed = []
    for i, prompt in enumerate(_interleaved(TEMPLATES, TOPICS)):
        mixed.append(prompt)
        if i % 10 == 9 and code:
            mixed.append(code.pop(0))
    return mixed + code


def training_prompts(n: int | None = None) -> list[str]:
    """Up to n prompts (all 4,488 when None): the first list's 632, then the new templates over every topic and
    the first templates over the new topics."""
    first = chat_prompts()
    seen = set(first)
    out = first + [p for p in _interleaved(TEMPLATES + MORE_TEMPLATES, TOPICS + MORE_TOPICS) if p not in seen]
    return out[:n] if n else out
