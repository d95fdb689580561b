"""The fixed benchmark prompt set. Each prompt is sent as one user chat message.

Three workloads:

* ``open``: free-form instructions (explanations, stories, lists, how-tos). The answer shares few
  n-grams with the prompt, so prompt lookup has little to copy; the draft model is the proposer.
* ``grounded``: a quoted passage (80-150 words, written for this benchmark) to rewrite, summarise or
  extract from, plus short code-editing tasks. Much of the answer copies spans of the prompt, which
  is where prompt-lookup drafting should shine.
* ``template``: the same instruction (extract a person's name, age, city and job as JSON) over 20
  different one-sentence inputs, sent in sequence through one coordinator: the answers repeat each
  other's structure, which the suffix proposer's tree of recent outputs (shared by the coordinator's
  sessions) learns as the requests go by. Always all 20, in order.

The order matters: quick runs take the first few prompts of each workload, so each workload starts
with a representative mix (quick ``grounded`` = a rewrite, a code edit and a summary).
Do not edit prompts in place once results are published: add new ones at the end instead, so older
sections of the run logs (docs/bench-logs/) stay comparable.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Prompt:
    id: str
    workload: str  # "open" | "grounded" | "template"
    kind: str  # what the task is: explain / story / list / howto / rewrite / summarise / extract / code / json
    content: str  # the user message

    @property
    def messages(self) -> list[dict]:
        return [{"role": "user", "content": self.content}]


def _passage(task: str, passage: str) -> str:
    return f"{task}\n\nPassage:\n\"\"\"\n{' '.join(passage.split())}\n\"\"\""


_LIGHTHOUSE = """
The lighthouse on Carrow Point was built in 1861 from granite quarried three miles inland and hauled
to the headland on sledges pulled by oxen. Its first keeper, Margaret Ellis, took over the post after
her husband drowned while rowing supplies out to a stranded schooner. For twenty-two years she climbed
the one hundred and twelve steps twice each night to trim the wicks and wind the clockwork that turned
the lens. In the great storm of 1874 the lamp room windows shattered, and she kept the light burning
by holding a canvas sheet against the wind for most of the night. The lamp was converted to
electricity in 1936, and the last resident keeper left in 1979, when the light became fully automatic.
"""

_SOURDOUGH = """
A sourdough starter is a mixture of flour and water that has been colonised by wild yeasts and lactic
acid bacteria. To make one, stir together equal weights of whole wheat flour and lukewarm water in a
clean jar, cover it loosely, and leave it at room temperature. Every twenty-four hours, discard about
half of the mixture and feed the rest with fresh flour and water in the same proportions. After four
to seven days the starter should double in size within six to eight hours of feeding, smell pleasantly
sour, and be full of bubbles. At that point it is ready to bake with. A mature starter can be kept in
the refrigerator and fed once a week.
"""

_OCTOPUS = """
Octopuses are among the most intelligent invertebrates known. The common octopus has around five
hundred million neurons, roughly two thirds of which are located in its eight arms rather than in its
central brain, so each arm can taste, touch and react to its surroundings with a degree of
independence. In laboratory studies octopuses have learned to unscrew jar lids, navigate simple
mazes, and recognise individual human keepers, sometimes squirting water at people they dislike. They
change colour and skin texture in a fraction of a second using specialised cells called chromatophores,
which lets them hide from predators and signal to one another. Most species live only one to two years,
and females usually die shortly after their eggs hatch.
"""

_MEETING = """
Minutes of the Riverside Community Garden meeting, held on Tuesday 4 March. Present: Priya Nair (chair),
Tom Becker, Ana Lucia Ortiz, Sam Okafor and Helen Marsh. The committee agreed to replace the broken
water pump before 1 April; Tom will collect three quotes and circulate them by 15 March. Membership
fees will stay at 25 pounds a year, but a reduced rate of 10 pounds will be offered to students and
pensioners. Ana Lucia reported that the compost bins are overflowing and proposed a rota for turning
them; volunteers should sign up on the noticeboard. Sam will organise the spring seed swap on Saturday
22 March from 10am to 1pm. Helen raised concerns about the locked gate code being shared online; the
code will be changed next week. The next meeting is on Tuesday 1 April at 7pm in the church hall.
"""

_BATTERY = """
Lithium-ion batteries wear out gradually rather than failing all at once. Each charge and discharge
cycle causes small side reactions inside the cell that consume lithium and thicken a layer on the
anode called the solid electrolyte interphase, which slowly reduces capacity. Heat speeds these
reactions up, so a phone left on a car dashboard in summer ages much faster than one kept at room
temperature. Keeping a battery at one hundred percent charge for long periods also stresses it,
which is why many laptops now offer a setting that stops charging at eighty percent. Deep discharges
to zero are harmful as well. For the longest life, manufacturers recommend keeping the charge between
twenty and eighty percent and avoiding high temperatures.
"""

_MARKET = """
The night market on Lantern Street opens at six every evening, when about forty stalls unfold their
awnings along both sides of the road. The most popular stall sells hand-pulled noodles in a spicy
beef broth, and the queue there often stretches past the bakery on the corner. Further down, an old
man repairs watches under a single bare bulb, and next to him a young couple sells handmade soap
scented with lavender and orange peel. Children crowd around a stall where a woman shapes tiny animals
out of sugar syrup, and tourists photograph the rows of paper lanterns strung above the street.
By midnight the stalls are folded away, the street is swept, and only the smell of grilled corn remains.
"""

_VOLCANO = """
Mount Tavara is a stratovolcano that rises 2,860 metres above the surrounding plain. Its last major
eruption, in 1912, sent an ash column an estimated twenty kilometres into the air and buried the
village of Selmi under two metres of pumice, although most of its residents had already fled after
weeks of small earthquakes. Since then the volcano has been quiet apart from steam vents near the
summit and a minor ash emission in 1987. Today the mountain is monitored by six seismometers, two GPS
stations and a gas sensor that measures sulphur dioxide. Scientists consider the risk of an eruption
in the next decade to be low, but evacuation routes are signposted in all nearby towns and are
practised every two years.
"""

_LIBRARY = """
The city library will move its opening hours from 1 September. On weekdays it will open at 9am instead
of 10am and close at 8pm instead of 6pm, so that people who work during the day can visit in the
evening. On Saturdays the hours stay the same, from 10am to 4pm, and the library will remain closed on
Sundays and public holidays. The children's section will host a story time every Wednesday at 4pm,
and a free computer help desk will run on Tuesday and Thursday evenings from 6pm to 8pm. Books can
now be borrowed for four weeks instead of three, and each member may renew an item up to three times
online. Late fees for children's books will be removed entirely.
"""

_CODE_DISCOUNT = '''
def apply_discount(price, percent):
    """Return the price after taking off `percent` percent."""
    discount = price * percent / 100
    return price - discount
'''

_CODE_WORDS = '''
def count_words(text):
    counts = {}
    for word in text.split():
        if word in counts:
            counts[word] += 1
        else:
            counts[word] = 1
    return counts
'''

_CODE_INVENTORY = '''
class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, quantity):
        self.items[name] = self.items.get(name, 0) + quantity

    def remove(self, name, quantity):
        self.items[name] = self.items[name] - quantity

    def total(self):
        return sum(self.items.values())
'''


def _code(task: str, code: str) -> str:
    return f"{task}\n\n```python\n{code.strip()}\n```"


PROMPTS: list[Prompt] = [
    # --- open -------------------------------------------------------------------------------------
    Prompt("open-explain-fridge", "open", "explain",
           "Explain how a refrigerator keeps food cold. Describe the role of the refrigerant, the "
           "compressor and the coils in simple terms."),
    Prompt("open-story-robot", "open", "story",
           "Write a short story about a small robot who works in a lighthouse and discovers that it "
           "is afraid of the dark."),
    Prompt("open-list-study", "open", "list",
           "Give me a numbered list of ten practical tips for studying effectively for an exam, with "
           "one sentence of explanation for each tip."),
    Prompt("open-howto-tire", "open", "howto",
           "How do I change a flat tire on a car? Give step-by-step instructions for a beginner."),
    Prompt("open-explain-seasons", "open", "explain",
           "Why does the Earth have seasons? Explain it to a curious twelve-year-old."),
    Prompt("open-story-dragon", "open", "story",
           "Write a bedtime story about a dragon who wants to become a baker."),
    Prompt("open-list-city", "open", "list",
           "List eight things to consider when choosing a city to move to, and briefly say why each "
           "one matters."),
    Prompt("open-howto-email", "open", "howto",
           "How should I write a polite email asking my manager for a day off next week? Explain the "
           "structure and then give an example."),
    # --- grounded ---------------------------------------------------------------------------------
    Prompt("grounded-rewrite-lighthouse", "grounded", "rewrite",
           _passage("Rewrite the following passage in the present tense, keeping every fact and as "
                    "much of the original wording as possible.", _LIGHTHOUSE)),
    Prompt("grounded-code-discount", "grounded", "code",
           _code("Modify this function so that it raises a ValueError if `percent` is negative or "
                 "greater than 100, and rounds the result to two decimal places. Return the whole "
                 "updated function.", _CODE_DISCOUNT)),
    Prompt("grounded-summarise-octopus", "grounded", "summarise",
           _passage("Summarise the following passage in three sentences.", _OCTOPUS)),
    Prompt("grounded-extract-meeting", "grounded", "extract",
           _passage("From the meeting minutes below, extract every action item as a bullet list in "
                    "the form 'Person: task (deadline)'.", _MEETING)),
    Prompt("grounded-rewrite-sourdough", "grounded", "rewrite",
           _passage("Rewrite the following instructions as a numbered list of steps, reusing the "
                    "original sentences where you can.", _SOURDOUGH)),
    Prompt("grounded-code-words", "grounded", "code",
           _code("Change this function so that it ignores case and strips punctuation from each word "
                 "before counting. Add a docstring. Return the complete function.", _CODE_WORDS)),
    Prompt("grounded-summarise-battery", "grounded", "summarise",
           _passage("Summarise the advice in the passage below in two or three sentences.", _BATTERY)),
    Prompt("grounded-extract-library", "grounded", "extract",
           _passage("List every change announced in the following notice as short bullet points, "
                    "quoting the times and numbers exactly.", _LIBRARY)),
    Prompt("grounded-rewrite-market", "grounded", "rewrite",
           _passage("Rewrite the following passage from the point of view of a visitor, in the first "
                    "person, keeping the details.", _MARKET)),
    Prompt("grounded-code-inventory", "grounded", "code",
           _code("Update the `remove` method of this class so that it raises a KeyError for unknown "
                 "items and a ValueError if there is not enough stock, and deletes an item when its "
                 "quantity reaches zero. Return the whole class.", _CODE_INVENTORY)),
    Prompt("grounded-extract-volcano", "grounded", "extract",
           _passage("Answer using only the passage below: list every number it mentions and what each "
                    "number refers to.", _VOLCANO)),
]

_EXTRACT_JSON = ("Extract the person's name, age, city and job from the text below. Reply with only a JSON object "
                 'with the keys "name", "age", "city" and "job".\n\nText: ')

_PEOPLE = [
    "Maria Lopez is a 34-year-old nurse who lives in Valencia and cycles to the hospital every morning.",
    "At 52, Tom Becker still runs the bakery in Hamburg that his father opened, working as its head baker.",
    "Priya Nair, a 28-year-old software engineer, moved to Toronto last spring for a new job.",
    "Kenji Watanabe teaches history at a secondary school in Osaka; he turned 45 in March.",
    "The Lyon firefighter Claire Dubois, 39, has served with the city's brigade for fifteen years.",
    "Samuel Okafor is a 61-year-old taxi driver in Lagos who knows every shortcut in the city.",
    "Anna Kowalska, 23, works as a junior architect at a small studio in Krakow.",
    "Diego Fernandez has been a fisherman in Valparaiso for most of his 57 years.",
    "Fatima Zahra is a 31-year-old pharmacist who opened her own shop in Casablanca.",
    "Liam O'Brien, a 26-year-old plumber from Dublin, fixes boilers across the north of the city.",
    "Sofia Rossi teaches the violin in Bologna and will be 48 this summer.",
    "Ahmed Hassan, 35, is a civil engineer designing bridges for the port authority in Alexandria.",
    "In Melbourne, 29-year-old Chloe Nguyen works night shifts as an emergency doctor.",
    "Erik Johansson, a 67-year-old retired pilot, now flies model planes in a park in Gothenburg.",
    "Grace Mwangi is a 42-year-old journalist who reports on farming for a newspaper in Nairobi.",
    "Lucas Martin, 19, is an apprentice electrician in Marseille.",
    "Hannah Schmidt, a 55-year-old librarian, manages the central library in Vienna.",
    "Rahul Gupta works as a chef in a busy restaurant in Mumbai and is 37 years old.",
    "Isabel Costa, 44, is a dentist with a practice near the old town of Porto.",
    "Oliver Smith, a 33-year-old gardener, looks after the botanical gardens in Edinburgh.",
]

PROMPTS += [Prompt(f"template-json-{i:02d}", "template", "json", _EXTRACT_JSON + text) for i, text in enumerate(_PEOPLE)]

WORKLOADS = ("open", "grounded", "template")


def prompts_for(workload: str, limit: int | None = None) -> list[Prompt]:
    if workload not in WORKLOADS:
        raise ValueError(f"unknown workload {workload!r}; choose from {WORKLOADS}")
    selected = [p for p in PROMPTS if p.workload == workload]
    return selected[:limit] if limit else selected


_PASSAGES = (("lighthouse", _LIGHTHOUSE), ("sourdough", _SOURDOUGH), ("octopus", _OCTOPUS), ("meeting", _MEETING),
             ("battery", _BATTERY), ("market", _MARKET), ("volcano", _VOLCANO), ("library", _LIBRARY))


def passage_word_counts() -> dict[str, int]:
    """Words in each quoted passage (the spec asks for 80-150); used by a sanity check in run.py."""
    return {name: len(text.split()) for name, text in _PASSAGES}


def passages() -> list[str]:
    """The quoted passages' texts, one paragraph each (text to score: bench.scoring)."""
    return [" ".join(text.split()) for _, text in _PASSAGES]
