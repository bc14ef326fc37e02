"""Prompts assembled for the target to answer, so a head learns from the target's own responses (EAGLE-3's advice:
regenerated responses, not fixed text).

None is a prompt of the bench's sets (``corpus.clean`` checks): they are built from templates written for this
project and from the Python standard library (function signatures and docstrings, ``pydoc_data``'s reference
topics; the Python Software Foundation License). They cover the kinds the bench measures (code, chat, math, short
questions, translation, summarisation, extraction, reasoning) in new words. Deterministic for one Python and seed.
"""

from __future__ import annotations

import ast
import random

from .corpus import stdlib_texts

PEOPLE = ("Amara", "Bruno", "Chen", "Dalia", "Emeka", "Freya", "Goran", "Hana", "Ivo", "Jun", "Kira", "Lucas",
          "Mina", "Nils", "Olga", "Pavel", "Rosa", "Sami", "Tara", "Umar", "Vera", "Wim", "Yara", "Zoe")
GOODS = (("apples", 2), ("mugs", 6), ("tickets", 12), ("books", 9), ("plants", 5), ("scarves", 14),
         ("batteries", 3), ("candles", 4), ("sandwiches", 7), ("posters", 8))
TOPICS = ("photosynthesis", "the water cycle", "plate tectonics", "the French Revolution", "inflation",
          "the immune system", "black holes", "compound interest", "the printing press", "vaccines", "tides",
          "the Roman Empire", "machine learning", "recycling", "the stock market", "volcanoes", "rainbows",
          "the Silk Road", "antibiotics", "electric cars", "the Renaissance", "coral reefs", "jet engines",
          "democracy", "the internet", "earthquakes", "honey bees", "solar panels", "the Moon landing",
          "climate change", "DNA", "the Great Wall of China", "supply and demand", "hash tables", "recursion",
          "public-key cryptography", "garbage collection", "version control", "unit testing", "HTTP caching")
FORMS = ("a short poem", "a four-sentence story", "a friendly email", "a product description", "a limerick",
         "a short speech", "a diary entry", "a haiku sequence", "a motivational note", "a short blog introduction")
SUBJECTS = ("a lighthouse keeper", "the first day of spring", "a lost umbrella", "a city at night", "a robot gardener",
            "a rainy train journey", "an old bicycle", "a mountain village", "a new coffee shop", "a chess match",
            "a cat who learns to swim", "moving to a new country", "a school science fair", "the ocean at dawn")
ROLES = ("a museum guide", "a ship's captain", "a patient piano teacher", "a travel agent", "a detective",
         "a chef on a cooking show", "a park ranger", "a librarian", "a sports coach", "a time traveller")
SENTENCES = ("The library opens at nine and closes at six on weekdays.",
             "My brother bought a new bicycle because his old one was stolen.",
             "Please remember to water the plants while I am away.",
             "We are planning a picnic by the lake if the weather stays dry.",
             "The meeting has been moved to Thursday afternoon.",
             "She has been learning to play the violin for three years.",
             "Could you tell me where the nearest pharmacy is?",
             "The train was late, so we missed the beginning of the concert.",
             "Our neighbours are painting their house blue this summer.",
             "I would like to book a table for four people at seven o'clock.",
             "The children built a snowman in the garden this morning.",
             "He forgot his keys and had to wait outside for an hour.")
LANGUAGES = ("German", "French", "Spanish", "Italian", "Dutch")


def code_prompts(rng: random.Random, n: int) -> list[str]:
    """Write-a-function prompts from standard-library functions that have a docstring (name, arguments, the
    docstring's first sentence)."""
    found = []
    for _name, source in stdlib_texts(limit_chars=3_000_000):
        try:
            tree = ast.parse(source)
        except SyntaxError:
            continue
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and not node.name.startswith("_"):
                doc = (ast.get_docstring(node) or "").strip().split("\n\n")[0].replace("\n", " ")
                if 30 <= len(doc) <= 300:
                    args = ", ".join(a.arg for a in node.args.args)
                    found.append((node.name, args, doc))
    rng.shuffle(found)
    styles = ("Write a Python function `{n}({a})`. {d}",
              "Implement `{n}({a})` in Python with a docstring and type hints. It should do this: {d}",
              "Here is a description of a function: \"{d}\" Write `{n}({a})` in Python and explain it briefly.",
              "def {n}({a}):\n    \"\"\"{d}\"\"\"\n\nComplete this Python function.")
    return [rng.choice(styles).format(n=f, a=a, d=d) for f, a, d in found[:n]]


def math_prompts(rng: random.Random, n: int) -> list[str]:
    """Word problems with fresh names and numbers, solved step by step."""
    out = []
    for _ in range(n):
        who, other = rng.sample(PEOPLE, 2)
        (goods, price), (goods2, price2) = rng.sample(GOODS, 2)
        a, b, c = rng.randint(2, 9), rng.randint(2, 6), rng.randint(20, 90)
        out.append(rng.choice((
            f"{who} buys {a} {goods} at ${price} each and {b} {goods2} at ${price2} each. How much change does "
            f"{who} get from ${c + a * price + b * price2}? Explain step by step.",
            f"{who} reads {a * 5} pages a day and {other} reads {b * 4} pages a day. A book has {c * 10} pages. "
            f"How many days does each need to finish it, and who finishes first?",
            f"A garden has {a} rows of {b * 3} tulips. {who} picks {c // 4} tulips and gives a third of the rest "
            f"to {other}. How many tulips are left in the garden after that?",
            f"A car uses {a} litres of fuel per 100 km. Fuel costs ${price2}.{b}0 a litre. What does a trip of "
            f"{c * 5} km cost? Show your working.",
            f"{who} saves ${a * 5} every week and already has ${c}. How many weeks until {who} can buy {b} {goods} "
            f"at ${price * 10} each?")))
    return out


def chat_prompts(rng: random.Random, n: int) -> list[str]:
    """Writing, role-play and explanation requests."""
    out = []
    for _ in range(n):
        out.append(rng.choice((
            f"Write {rng.choice(FORMS)} about {rng.choice(SUBJECTS)}.",
            f"Pretend you are {rng.choice(ROLES)}. Describe your typical morning to a visitor.",
            f"Explain {rng.choice(TOPICS)} to a twelve-year-old in a few paragraphs.",
            f"What are the pros and cons of {rng.choice(TOPICS)}? Answer with a short list.",
            f"Give me five practical tips for someone writing about {rng.choice(SUBJECTS)}.",
            f"You are {rng.choice(ROLES)}. A visitor asks about {rng.choice(TOPICS)}. What do you say?")))
    return out


def qa_prompts(rng: random.Random, n: int) -> list[str]:
    """Short factual questions."""
    return [rng.choice(("What is {t}? Answer in two sentences.", "Who first studied {t}, and why does it matter?",
                        "In one paragraph: how does {t} work?", "Name three facts about {t}."))
            .format(t=rng.choice(TOPICS)) for _ in range(n)]


def translation_prompts(rng: random.Random, n: int) -> list[str]:
    """English sentences to translate (pairs of them, into one of five languages)."""
    return [rng.choice(("Translate into {l}:\n\n{s}", "Please translate this into natural {l}.\n\n\"{s}\"",
                        "English to {l}:\n\n{s}")).format(l=rng.choice(LANGUAGES), s=" ".join(rng.sample(SENTENCES, 2)))
            for _ in range(n)]


def summary_prompts(rng: random.Random, n: int) -> list[str]:
    """Summaries and extractions of Python reference topics (``pydoc_data``)."""
    from pydoc_data.topics import topics

    texts = [t for t in topics.values() if 600 <= len(t) <= 4000]
    out = []
    for _ in range(n):
        text = rng.choice(texts).strip()
        out.append(rng.choice(("Summarise the following text in three sentences:\n\n{x}",
                               "{x}\n\nGive a short summary of the text above for a beginner.",
                               "List the key terms defined in this text, one line each:\n\n{x}")).format(x=text))
    return out


def reasoning_prompts(rng: random.Random, n: int) -> list[str]:
    """Small logic and ordering puzzles."""
    out = []
    for _ in range(n):
        a, b, c = rng.sample(PEOPLE, 3)
        out.append(rng.choice((
            f"{a} is taller than {b}, and {b} is taller than {c}. Who is the shortest? Explain your reasoning.",
            f"If it rains, {a} takes the bus. Today {a} did not take the bus. What can we conclude? Think it through.",
            f"{a}, {b} and {c} finished a race. {a} was not first, {c} finished right after {a}. What was the order?",
            f"Every {rng.choice(GOODS)[0][:-1]} in the shop is either red or blue. {a} says none are blue, {b} says "
            f"at least one is blue. Exactly one of them is right, and the shop has a red one. Who could be right?")))
    return out


KINDS = {"code": code_prompts, "math": math_prompts, "chat": chat_prompts, "qa": qa_prompts,
         "translation": translation_prompts, "summarisation": summary_prompts, "reasoning": reasoning_prompts}


def training_prompts(per_kind: int = 40, seed: int = 0) -> list[tuple[str, str]]:
    """``(kind, prompt)`` pairs: ``per_kind`` of each kind (``KINDS``), none holding a bench prompt, interleaved by
    kind so that any prefix of the list covers every kind."""
    rng = random.Random(seed)
    return interleaved({kind: make(rng, per_kind) for kind, make in KINDS.items()})


def interleaved(by_kind: dict[str, list[str]]) -> list[tuple[str, str]]:
    """``(kind, prompt)`` pairs taking one prompt of each kind in turn (so any prefix covers every kind), without
    those that hold a bench prompt (``corpus.clean``)."""
    from .corpus import clean

    longest = max((len(ps) for ps in by_kind.values()), default=0)
    mixed = [(kind, ps[i]) for i in range(longest) for kind, ps in by_kind.items() if i < len(ps)]
    kept, _ = clean([(f"{kind}:{i}", p) for i, (kind, p) in enumerate(mixed)])
    return [(name.split(":")[0], p) for name, p in kept]
