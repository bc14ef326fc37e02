"""Prompts the target writes itself (self-instruct, Wang et al. 2023, arXiv 2212.10560), for a head's training data.

Template-built prompts (``prompts.py``) run out of new shapes: a head trained on their responses agrees with the
target far less on the responses to real requests (the bench's HumanEval functions, MT-bench's writing and
role-play, news to summarise, emails to translate) than on held-out template responses. Here the target is asked to
*write* such requests, one per slot (a topic, a scenario, a domain drawn from the lists below, greedy, so the
result is deterministic for one pair and seed), and each written text is wrapped as the user would send it (a
function signature to complete, an article to summarise, sentences to translate). The target's responses to them
(``respond.respond``) are then the head's data. What the target writes is its own output; no prompt of the bench's
sets is used or kept (``corpus.clean``).
"""

from __future__ import annotations

import random
import re

DOMAINS = ("string manipulation", "lists of numbers", "dates and calendars", "2D geometry", "bank accounts",
           "shop inventory", "student grades", "parsing log lines", "matrices", "prime numbers", "sorting records",
           "recursion on trees", "word counting", "sets of tags", "file paths", "URLs", "RGB colours",
           "temperature conversion", "time intervals", "a queue of tasks", "graphs given as adjacency lists",
           "merging intervals", "run-length encoding", "validating passwords", "roman numerals", "binary strings",
           "shopping carts and discounts", "a simple tokenizer", "CSV rows", "JSON-like nested dictionaries",
           "moving averages", "anagrams", "palindromes", "the Fibonacci sequence", "greatest common divisors",
           "a tic-tac-toe board", "a deck of cards", "bus timetables", "unit conversion", "caesar ciphers",
           "histograms", "flattening nested lists", "pairs that sum to a target", "digits of an integer",
           "vowels and consonants", "leap years", "rectangles that overlap", "a to-do list", "polynomials",
           "phone numbers")
LEVELS = ("an easy", "a medium-difficulty", "a short but tricky")
REQUESTS = ("planning a week-long trip to Japan", "a cover letter for a junior designer job", "a wedding toast",
            "a slogan for a bakery", "an outline for a blog post about remote work", "comparing two laptops",
            "a beginner's workout plan", "a polite complaint to a landlord", "a birthday poem for a grandmother",
            "names for a podcast about history", "a product description for a reusable water bottle",
            "a short story that starts with a missed train", "a speech for a school graduation",
            "tips for a first job interview", "a meal plan for a vegetarian week", "a persuasive essay on public "
            "libraries", "a LinkedIn post announcing a new job", "an apology email for a late delivery",
            "a lesson plan about fractions", "a script for a 30-second radio advert", "a travel guide to Lisbon",
            "a summary of the pros and cons of electric scooters", "rules for a new board game",
            "a thank-you note to a mentor", "a social media post for a charity run", "a study schedule for exams",
            "a dialogue between two characters meeting again after years", "a review of a fictional restaurant",
            "a pitch for a mobile app that helps people save money", "advice on keeping houseplants alive",
            "an email inviting colleagues to a team lunch", "a description of a fantasy city",
            "ideas for a science fair project", "a letter to a future self", "a packing list for a camping trip",
            "explaining a budget to a teenager", "a newsletter introduction for a gardening club",
            "a motivational message for a sports team", "a welcome message for new employees",
            "an argument for and against homework")
ROLES = ("a medieval knight", "a famous chef", "a startup founder", "a pirate captain", "a wise old librarian",
         "a space station engineer", "a detective in 1920s London", "a friendly tour guide in Rome",
         "a personal fitness coach", "a marine biologist", "a stand-up comedian", "a history teacher",
         "an astronaut returning to Earth", "a customer support agent", "a sommelier", "a travelling musician",
         "a park ranger", "a chess grandmaster", "a veterinarian", "a 19th-century inventor")
TOPICS = ("sleep", "volcanoes", "the moon's phases", "compound interest", "how airplanes fly", "honey bees",
          "the human heart", "recycling plastic", "how vaccines work", "rainbows", "the speed of light",
          "inflation", "how batteries store energy", "why the sky is blue", "tides", "photosynthesis",
          "the stock market", "black holes", "earthquakes", "how the internet works", "caffeine", "memory",
          "the Roman Empire", "glaciers", "solar power", "antibiotics", "the printing press", "coral reefs",
          "time zones", "credit scores", "cloud computing", "password security", "the Olympic Games",
          "migrating birds", "desert plants", "the water cycle", "electric cars", "dinosaurs", "DNA", "music scales")
SCENARIOS = ("a bakery's daily orders", "a school trip budget", "saving money for a bicycle", "painting a fence",
             "a train journey with two legs", "sharing pizzas at a party", "a garden with rows of vegetables",
             "a library's book loans", "a car's fuel use", "a running club's weekly distances", "buying paint",
             "a farmer's market stall", "tiling a kitchen floor", "a concert's ticket sales", "filling a water tank",
             "a recipe scaled for more guests", "a phone plan's monthly cost", "a bookshop sale with discounts",
             "planting trees in a park", "a cinema's seats and prices")
PUZZLES = ("five friends standing in a queue", "three boxes with wrong labels", "truth-tellers and liars on an "
           "island", "scheduling four meetings in one day", "coins where one is fake", "seating guests around a "
           "table", "crossing a river with a boat that holds two", "ages of three siblings", "the colours of four "
           "houses in a row", "a race between five runners", "which light switch controls which bulb",
           "sorting books on a shelf by rules", "a tournament where everyone plays everyone", "two clocks that "
           "run at different speeds", "socks in a dark drawer")
SETTINGS = ("an email to a colleague about a delayed project", "a message to a friend about weekend plans",
            "a hotel booking request", "a note to a neighbour about a parcel", "a restaurant review",
            "directions to a train station", "a complaint about a broken product", "a doctor's appointment",
            "a school newsletter", "instructions for a washing machine", "a job application", "a weather report",
            "a museum's opening hours", "a birthday invitation", "a thank-you card", "a lost-and-found notice")
EVENTS = ("a new bridge opening", "a local election result", "a factory closing", "a festival breaking attendance "
          "records", "a flood after heavy rain", "a company's quarterly results", "a new train line",
          "a school winning a science prize", "a heatwave and water restrictions", "a museum reopening after "
          "repairs", "a hospital getting new equipment", "a football club's surprise win", "a power cut",
          "a tech start-up raising money", "a rise in bus fares", "a wildlife reserve expanding",
          "a recall of a faulty kettle", "a city banning cars from its centre", "a record harvest",
          "a library adding late opening hours")
LANGUAGES = ("German", "German", "French", "Spanish", "Italian")
ANGLES = ("in a casual tone", "asking for a short answer", "asking for an example", "comparing it with something "
          "similar")
TONES = ("formal", "friendly", "urgent", "apologetic", "enthusiastic")
PLACES = ("a coastal town", "a mountain village", "a large city", "a software company", "a car maker",
          "a university town", "a farming region", "a family-owned supermarket chain")
FRAMES = ("with people of your choice", "with animals instead of people", "set in a school", "set in an office",
          "set on a spaceship")

WRITERS = {
    "code": lambda rng: (f"Invent {rng.choice(LEVELS)} Python programming exercise about {rng.choice(DOMAINS)}. "
                         "Write only the function's signature with type hints and a docstring that states the task "
                         "and gives two doctest examples, in one ```python block. Do not write the function body."),
    "chat": lambda rng: rng.choice((
        "Here is a message a user sent to a chatbot: \"Write a four-line poem about autumn leaves for my daughter's "
        "school project. Keep it simple and cheerful.\" Write a different message a user might send, asking for "
        f"{rng.choice(REQUESTS)}, with details such as length, tone or audience. Write only the message.",
        "Here is a message a user sent to a chatbot: \"Pretend you are a lighthouse keeper and tell me about the "
        f"worst storm you have seen.\" Write a different message in which a user asks the chatbot to pretend to be "
        f"{rng.choice(ROLES)} and to answer a question in character. Write only the message.")),
    "qa": lambda rng: (f"Write one question a curious adult might ask about {rng.choice(TOPICS)}, "
                       f"{rng.choice(ANGLES)}. Write only the question."),
    "math": lambda rng: (f"Write a grade-school math word problem about {rng.choice(SCENARIOS)} with concrete "
                         f"numbers that takes {rng.choice(('two', 'three', 'three or four'))} steps to solve. Ask "
                         "for the working to be shown. Write only the problem, not the answer."),
    "reasoning": lambda rng: (f"Write a short logic puzzle about {rng.choice(PUZZLES)}, {rng.choice(FRAMES)}, "
                              "that has one clear answer. "
                              "Ask the reader to explain their reasoning. Write only the puzzle, not the answer."),
    "translation": lambda rng: (f"Write a short message of two sentences that someone might write in "
                                f"{rng.choice(SETTINGS)}, in a {rng.choice(TONES)} tone. Write only the message."),
    "summarisation": lambda rng: (f"Write a news article of about 150 words about {rng.choice(EVENTS)} in "
                                  f"{rng.choice(PLACES)} (made up), with names, numbers and a quote. Write only the "
                                  "article, without a headline."),
}
# the most tokens a writing of each kind may take: a cut article ends at its last full sentence, other cut texts go
WRITE_TOKENS = {"code": 192, "chat": 96, "qa": 64, "math": 128, "reasoning": 128, "translation": 96,
                "summarisation": 256}


def writing_prompts(per_kind: int, seed: int = 0) -> list[tuple[str, str]]:
    """``(kind, instruction)`` pairs asking the target to write a request of each kind (``WRITERS``), ``per_kind``
    distinct ones per kind where the lists allow (fewer otherwise). Deterministic for one seed."""
    rng, out = random.Random(seed), []
    for kind, write in WRITERS.items():
        seen: set[str] = set()
        for _ in range(per_kind * 20):
            if len(seen) == per_kind:
                break
            text = write(rng)
            if text not in seen:
                seen.add(text)
                out.append((kind, text))
    return out


def _strip(text: str) -> str:
    """The written text without a chat model's wrapping: surrounding quotes and a leading label ("Request:")."""
    text = text.strip().strip('"').strip()
    text = re.sub(r"^(\*\*)?(request|question|problem|puzzle|instruction|article|sentences?)(\*\*)?\s*:\s*(\*\*)?",
                  "", text, flags=re.I).strip()
    return text


def wrap(kind: str, written: str, rng: random.Random, complete: bool = True) -> str | None:
    """The user's request built from what the target wrote for ``kind`` (None when it wrote nothing usable: no
    code block for ``code``, too short or too long a text, or, ``complete`` False, a text the token limit cut,
    except an article, which is cut at its last full sentence)."""
    if not complete and kind != "summarisation":
        return None
    if kind == "code":
        block = re.search(r"```(?:python)?\n(.*?)```", written, flags=re.S)
        code = block.group(1).strip("\n") if block else ""
        if "def " not in code or '"""' not in code or len(code) > 1500:
            return None
        return rng.choice(("Complete the following Python function.\n\n```python\n{c}\n```",
                           "Write the body of this Python function:\n\n```python\n{c}\n```",
                           "```python\n{c}\n```\n\nImplement the function above.")).format(c=code)
    text = _strip(written)
    if not 20 <= len(text) <= 2000 or "```" in text:
        return None
    if kind == "translation":  # a numbered list of sentences, as the target often writes them, read as prose
        text = " ".join(re.sub(r"^\s*(\d+[.)]|[-*])\s*", "", line).strip().strip('"')
                        for line in text.splitlines() if line.strip())
        return rng.choice(("Translate into {l}:\n\n{s}", "Could you translate this into natural {l}?\n\n\"{s}\"",
                           "English to {l}, please:\n\n{s}")).format(l=rng.choice(LANGUAGES), s=text)
    if kind == "summarisation":
        text = text[: text.rfind(".") + 1]  # an article cut by the token limit ends at its last full sentence
        if len(text) < 400:
            return None
        return rng.choice(("Summarise the following article in two or three sentences:\n\n{a}",
                           "{a}\n\nSummarize the news story above in one short paragraph.",
                           "Give a summary of this article in three bullet points:\n\n{a}")).format(a=text)
    return text


def written_prompts(records: list[dict], seed: int = 0) -> list[tuple[str, str]]:
    """``(kind, prompt)`` pairs from the target's written texts (``respond`` records of ``writing_prompts``:
    ``kind``, ``response`` and ``complete``), each wrapped as a user would send it (``wrap``); unusable texts,
    repeats and any text holding a bench prompt (``corpus.clean``) are left out. Interleaved by kind."""
    from .prompts import interleaved

    rng, by_kind, seen = random.Random(seed), {}, set()
    for r in records:
        prompt = wrap(r["kind"], r["response"], rng, r.get("complete", True))
        if prompt is not None and prompt not in seen:
            seen.add(prompt)
            by_kind.setdefault(r["kind"], []).append(prompt)
    return interleaved(by_kind)
