"""Prompts for self-distillation, written here, never taken from the benchmark.

Spec-Bench covers 13 kinds of request; each kind gets templates filled with
topics, and the kinds that work on a given text (summarize, extract, answer
from a passage, translate) take that text from what is installed on this
machine: the Python reference (``pydoc_data.topics``, in every CPython), the
docstrings of standard-library modules, and German message catalogues of
installed Debian packages (``/usr/share/locale/de``), when present. Nothing is
downloaded. The prompt list depends only on the seed and on those files.
"""
from __future__ import annotations

import gettext
import glob
import importlib
import random
import re
from dataclasses import dataclass

CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
              "translation", "summarization", "qa", "math_reasoning", "rag")


@dataclass(frozen=True)
class Prompt:
    category: str
    text: str
    # A conversation to answer, ((role, content), ...), ending with the user's turn `text`; empty: `text`
    # alone is the user's turn. Only requests from a file (distill.prompts_file) carry one.
    messages: tuple[tuple[str, str], ...] = ()


TOPICS = [
    "bicycle maintenance", "urban gardening", "deep sea exploration", "medieval castles", "coffee farming",
    "renewable energy", "volcanoes", "the history of printing", "chess openings", "honeybees", "public libraries",
    "electric cars", "mountain climbing", "jazz music", "ancient Egypt", "rainforests", "space telescopes",
    "bread baking", "remote work", "ocean tides", "the Silk Road", "video game design", "recycling plastics",
    "sleep science", "marathon training", "classical architecture", "solar eclipses", "migratory birds",
    "the invention of the telephone", "street food", "glaciers", "photography", "public transport", "origami",
    "the Roman Empire", "vaccines", "desert ecosystems", "board games", "wind turbines", "coral reefs",
    "antique clocks", "robotics", "tea ceremonies", "lighthouses", "the water cycle", "typography",
    "beekeeping", "hiking safety", "small business accounting", "language learning", "museums", "submarines",
    "the printing press", "earthquakes", "knitting", "cloud computing", "farmers markets", "paper money",
    "the human heart", "northern lights", "opera", "railway history", "composting", "smartphone batteries",
    "wildfire prevention", "chocolate making", "the Renaissance", "dinosaurs", "weather forecasting",
    "online privacy", "wolves", "fermentation", "sailing", "suspension bridges", "folk tales", "podcasting",
    "airports", "the periodic table", "mushrooms", "city planning", "hot air balloons", "penguins",
]

PLACES = ["a mountain village", "a port city", "an island", "a desert town", "a river valley", "a northern capital",
          "a farming region", "a coastal fishing town", "a university town", "a national park"]
ROLES = ["a ship captain", "a medieval blacksmith", "a museum guide", "a detective", "a chef", "a park ranger",
         "a time traveller", "a librarian", "a stage magician", "an astronaut", "a pirate", "a travel agent",
         "a personal trainer", "a wizard", "a news anchor", "a kindergarten teacher", "a robot butler"]
NAMES = ["Mara", "Tomas", "Aiko", "Lena", "Ravi", "Olu", "Ines", "Pavel", "Noor", "Sam", "Hugo", "Priya"]
ITEMS = ["apples", "notebooks", "tickets", "marbles", "stamps", "cookies", "pencils", "books", "coins", "shirts"]
LANGS = ["Python", "JavaScript", "C", "Java", "Rust", "Go", "SQL", "Bash"]
TASKS = [
    "reverses a linked list", "checks whether a string is a palindrome", "merges two sorted lists",
    "counts word frequencies in a text", "finds the second largest number in a list", "computes Fibonacci numbers",
    "removes duplicates from a list while keeping order", "parses a CSV line into fields", "implements binary search",
    "validates an email address", "flattens a nested list", "computes the greatest common divisor",
    "rotates a matrix by 90 degrees", "finds all prime numbers below n", "implements a stack with a list",
    "converts Roman numerals to integers", "groups anagrams together", "computes a moving average",
    "implements a simple LRU cache", "checks if parentheses are balanced",
]
SUBJECTS = ["physics", "chemistry", "biology", "computer science", "astronomy", "geology", "economics",
            "psychology", "statistics", "ecology", "electrical engineering", "materials science"]
CONCEPTS = ["entropy", "photosynthesis", "inflation", "natural selection", "Ohm's law", "plate tectonics",
            "supply and demand", "the greenhouse effect", "recursion", "the Doppler effect", "osmosis",
            "compound interest", "the placebo effect", "black holes", "machine learning", "DNA replication",
            "opportunity cost", "the scientific method", "friction", "hash tables", "the immune system",
            "nuclear fusion", "cognitive dissonance", "exponential growth", "the food chain"]
HUMANITIES = ["the causes of the French Revolution", "the legacy of the Industrial Revolution",
              "the role of myths in ancient Greece", "the influence of Shakespeare", "the ethics of free speech",
              "the rise of the printing press", "colonialism in Africa", "the philosophy of Stoicism",
              "the impact of the Cold War", "the history of democracy", "impressionist painting",
              "the spread of world religions", "the Harlem Renaissance", "utilitarian ethics",
              "the fall of Constantinople", "the meaning of art", "the history of human rights",
              "the Meiji Restoration", "existentialism", "the Enlightenment"]

TEMPLATES: dict[str, list[str]] = {
    "writing": [
        "Write a short blog post about {topic} for beginners.",
        "Write a persuasive paragraph encouraging people to try {topic}.",
        "Write a short story set in {place} that involves {topic}.",
        "Compose a poem about {topic}.",
        "Write a formal letter to a city council proposing a project about {topic}.",
        "Write a product description for a new gadget related to {topic}.",
        "Draft a newsletter introduction about {topic} for a community group.",
        "Write a news report about a recent local event in {place} involving {topic}.",
        "Write a speech for a school assembly about {topic}.",
        "Describe a memorable day spent in {place}, in vivid detail.",
    ],
    "roleplay": [
        "Pretend you are {role}. Introduce yourself and describe a typical day.",
        "You are {role}. A visitor asks you about {topic}. Answer in character.",
        "Act as {role} and give advice to someone who is nervous about starting a new job.",
        "Imagine you are {role} writing a diary entry after a long day in {place}.",
        "Take on the role of {role}. Explain to a child what {topic} is.",
        "You are {role}. Convince me to visit {place}.",
    ],
    "reasoning": [
        "{n1} friends are sitting in a row. {name} sits to the left of {name2}. Explain how many different ways the "
        "remaining friends can be seated, step by step.",
        "If all {items} in a box are either red or blue, and there are {n1} more red ones than blue ones out of "
        "{n2} in total, how many are blue? Explain your reasoning.",
        "A train leaves at {h1}:00 and another leaves an hour later at a faster speed. What information do we need "
        "to know when the second train catches up? Reason step by step.",
        "{name} is older than {name2}, and {name2} is older than {name3}. Who is the youngest? Explain.",
        "What is the logical flaw in this argument: 'Every time I bring an umbrella it does not rain, so carrying "
        "an umbrella prevents rain about {topic}.'",
        "Solve this riddle and explain the answer: what gets wetter the more it dries?",
        "There are {n1} boxes; one contains a prize. Each time you open an empty box you learn which neighbours are "
        "empty. Describe a strategy to find the prize.",
    ],
    "math": [
        "What is {n1} multiplied by {n2}? Show your work.",
        "Solve for x: {n1}x + {n2} = {n3}.",
        "Find the area of a triangle with base {n1} cm and height {n2} cm.",
        "What is the sum of the integers from 1 to {n2}?",
        "Compute the derivative of f(x) = {n1}x^3 - {n2}x + {n3}.",
        "A circle has a radius of {n1} units. What are its circumference and area?",
        "What is {n3} percent of {n2}? Explain.",
        "Find the greatest common divisor of {n2} and {n3}.",
    ],
    "coding": [
        "Write a {lang} function that {task}.",
        "Explain what the following idea does and write it in {lang}: a function that {task}.",
        "How would you test a {lang} function that {task}? Give example test cases.",
        "Write a {lang} program that {task}, with comments.",
        "What is the time complexity of an algorithm that {task}? Give an implementation in {lang}.",
    ],
    "extraction": [
        "Extract every keyword from the following text and list them:\n{passage}",
        "From the text below, list all the technical terms with a one-line explanation each.\n{passage}",
        "Read the text and return a JSON object with the main subject and the three most important facts.\n{passage}",
        "Identify the rules described in this text and list them as bullet points.\n{passage}",
    ],
    "stem": [
        "Explain {concept} in simple terms.",
        "How does {concept} relate to everyday life? Give examples.",
        "What are the key ideas a student of {subject} should know about {concept}?",
        "Describe an experiment that demonstrates {concept}.",
        "What are common misconceptions about {concept}?",
        "Explain the basics of {subject} to a high school student.",
    ],
    "humanities": [
        "Discuss {hum}.",
        "What were the main consequences of {hum}?",
        "Write a short essay on {hum}.",
        "Compare two different views on {hum}.",
        "Why is {hum} still studied today?",
    ],
    "translation": [
        "Translate German to English: {german}",
        "Translate the following German sentence into English: {german}",
        "Translate to French: {english}",
        "Translate English to German: {english}",
    ],
    "summarization": [
        "Summarize: {passage}",
        "Summarize the following text in two sentences:\n{passage}",
        "Give a one-paragraph summary of this text.\n{passage}",
        "Write a short summary for a beginner:\n{passage}",
    ],
    "qa": [
        "What is {topic}?",
        "Who invented {invention}?",
        "Where can you see {topic}?",
        "When did people start {activity}?",
        "Why is {topic} important?",
        "How does {topic} work?",
        "What is the capital of {country}?",
        "What language is spoken in {country}?",
    ],
    "math_reasoning": [
        "{name} has {n1} {items}. {name2} gives {name} {n2} more, and then {name} gives away {n3}. How many {items} "
        "does {name} have now?",
        "A shop sells {items} at {n1} dollars each. {name} buys {n2} of them and pays with a {n4} dollar bill. "
        "How much change does {name} get?",
        "{name} walks {n1} kilometres every day for {n2} days, then rests for a day. How far has {name} walked in "
        "total?",
        "A class has {n2} students. {n1} of them like football and the rest like basketball. What fraction likes "
        "basketball?",
        "{name} saves {n1} dollars a week. How many weeks does it take to save {n4} dollars?",
        "A recipe needs {n1} eggs for {n2} people. How many eggs are needed for {n3} people?",
    ],
    "rag": [
        "{passage}\n\nBased on the text above, answer: what is the main point?",
        "Use the following passage to answer the question.\n{passage}\nQuestion: What does this text explain?",
        "{passage}\n\nAccording to the passage, what should a programmer keep in mind?",
        "Read this passage and answer the question at the end.\n{passage}\nQuestion: Give one example from the text.",
    ],
}

INVENTIONS = ["the telephone", "the light bulb", "the printing press", "the bicycle", "the radio", "the compass",
              "paper", "the steam engine", "the computer mouse", "the World Wide Web", "the microscope"]
ACTIVITIES = ["farming", "writing", "using money", "sailing", "brewing tea", "playing chess", "making glass"]
COUNTRIES = ["Portugal", "Kenya", "Peru", "Norway", "Vietnam", "Canada", "Egypt", "Chile", "Finland", "Thailand"]
ENGLISH = ["The weather will be sunny tomorrow morning.", "I would like to book a table for four people.",
           "The museum is closed on Mondays.", "Our train was delayed by twenty minutes.",
           "Please send me the report before Friday.", "She learned to play the piano as a child.",
           "The new bridge will open next year.", "We need more volunteers for the festival.",
           "He forgot his keys at the office again.", "The children planted trees in the park."]


def _passages() -> list[str]:
    """Paragraphs of 40-220 words from the Python reference and standard-library docstrings."""
    texts: list[str] = []
    try:
        from pydoc_data.topics import topics
        texts.extend(topics[name] for name in sorted(topics))
    except ImportError:
        pass
    for name in ("json", "csv", "logging", "argparse", "threading", "collections", "functools", "itertools",
                 "pathlib", "random", "statistics", "decimal", "fractions", "datetime", "heapq", "bisect",
                 "textwrap", "string", "shutil", "tempfile", "contextlib", "dataclasses", "enum", "unittest",
                 "sqlite3", "zipfile", "gzip", "socket", "subprocess", "calendar", "difflib", "pickle"):
        try:
            doc = importlib.import_module(name).__doc__
        except ImportError:
            continue
        if doc:
            texts.append(doc)
    paragraphs = []
    for text in texts:
        for block in re.split(r"\n\s*\n", text):
            words = block.split()
            # Prose only: grammar productions and code blocks are indented or symbol-heavy.
            if 40 <= len(words) <= 220 and sum(w.isalpha() for w in words) > 0.6 * len(words):
                paragraphs.append(" ".join(words))
    return paragraphs


def _german_sentences() -> list[str]:
    """German UI sentences from installed gettext catalogues (empty where none are installed)."""
    found = set()
    for path in sorted(glob.glob("/usr/share/locale/de/LC_MESSAGES/*.mo")):
        try:
            with open(path, "rb") as f:
                catalog = gettext.GNUTranslations(f)._catalog
        except Exception:  # noqa: BLE001 - a malformed catalogue only means fewer sentences
            continue
        for key, value in catalog.items():
            if (isinstance(key, str) and isinstance(value, str) and 6 <= len(value.split()) <= 30
                    and "%" not in value and "\n" not in value.strip() and "{" not in value):
                found.add(value.strip())
    return sorted(found)


def build_prompts(n_per_category: int, seed: int) -> list[Prompt]:
    """n_per_category distinct prompts for each of the 13 categories, in a seed-determined order."""
    rng = random.Random(seed)
    passages, german = _passages(), _german_sentences()
    prompts: list[Prompt] = []
    for category in CATEGORIES:
        seen: set[str] = set()
        for _ in range(n_per_category * 20):
            if len(seen) >= n_per_category:
                break
            template = rng.choice(TEMPLATES[category])
            n1, n2, n3 = rng.randint(2, 19), rng.randint(20, 99), rng.randint(3, 250)
            fields = dict(
                topic=rng.choice(TOPICS), place=rng.choice(PLACES), role=rng.choice(ROLES),
                name=NAMES[n1 % 6], name2=NAMES[6 + n2 % 6], name3=rng.choice(NAMES), items=rng.choice(ITEMS),
                lang=rng.choice(LANGS), task=rng.choice(TASKS), subject=rng.choice(SUBJECTS),
                concept=rng.choice(CONCEPTS), hum=rng.choice(HUMANITIES), invention=rng.choice(INVENTIONS),
                activity=rng.choice(ACTIVITIES), country=rng.choice(COUNTRIES), english=rng.choice(ENGLISH),
                n1=n1, n2=n2, n3=n3, n4=rng.choice([50, 100, 200, 500]), h1=rng.randint(6, 11),
                passage=rng.choice(passages) if passages else rng.choice(ENGLISH),
                german=rng.choice(german) if german else rng.choice(ENGLISH),
            )
            text = template.format(**fields)
            if text not in seen:
                seen.add(text)
                prompts.append(Prompt(category, text))
    rng.shuffle(prompts)
    return prompts
