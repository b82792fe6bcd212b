"""Training prompt templates for self-distillation (kept apart from ``ddtree/data/prompts.jsonl``).

Prompts are generated programmatically: topics x task templates for chat, code,
math and story requests, plus "explain this code" prompts built from snippets
of Python's own standard library. The default evaluation prompt set
(``ddtree/data/prompts.jsonl``) is never trained on: :func:`training_prompts`
drops any prompt that touches one of its subjects (see :data:`HELD_OUT_PHRASES`).
"""

from __future__ import annotations

import json
import random
import re
import sysconfig
from pathlib import Path

CHAT_TOPICS = [
    "photosynthesis", "the water cycle", "black holes", "volcanoes", "the immune system", "vaccines",
    "the stock market", "inflation", "renewable energy", "solar panels", "electric cars", "recycling",
    "the French Revolution", "the Roman Empire", "ancient Egypt", "the printing press", "the internet",
    "artificial intelligence", "machine learning", "blockchain", "cloud computing", "cybersecurity",
    "meditation", "sleep hygiene", "healthy eating", "running a marathon", "learning a new language",
    "public speaking", "time management", "saving money", "starting a small business", "job interviews",
    "gardening", "composting", "keeping houseplants alive", "baking bread", "making coffee", "cooking pasta",
    "dinosaurs", "honey bees", "whales", "migratory birds", "coral reefs", "rainforests", "deserts",
    "the moon landing", "Mars exploration", "the solar system", "gravity", "electricity", "magnets",
    "DNA", "evolution", "antibiotics", "the human heart", "the brain", "memory", "habits", "stress",
    "friendship", "teamwork", "leadership", "negotiation", "remote teams", "email etiquette",
    "chess", "playing the guitar", "photography", "drawing", "writing a novel", "reading more books",
    "climate change", "earthquakes", "hurricanes", "tides", "rainbows", "snowflakes", "the seasons",
    "democracy", "taxes", "voting", "human rights", "the Olympic Games", "football", "basketball",
    "yoga", "cycling", "hiking", "camping", "first aid", "fire safety", "budget travel", "packing light",
    "the Renaissance", "Shakespeare", "classical music", "jazz", "movies", "video games", "social media",
    "smartphones", "batteries", "3D printing", "robots", "quantum computers", "the speed of light",
    "bridges", "skyscrapers", "airplanes", "trains", "ships", "rockets", "satellites", "GPS",
    "libraries", "museums", "universities", "online courses", "homework", "exams", "note taking",
    "dogs", "horses", "owls", "octopuses", "penguins", "elephants", "spiders", "butterflies",
    "tea", "chocolate", "cheese", "rice", "spices", "vegetarian diets", "food waste", "water pollution",
]

CHAT_TASKS = [
    "Explain {t} in simple terms.",
    "What is {t}?",
    "Tell me three interesting facts about {t}.",
    "Why is {t} important?",
    "Give me a short introduction to {t}.",
    "What are the main advantages and disadvantages of {t}?",
    "How would you explain {t} to a ten-year-old?",
    "What are common misconceptions about {t}?",
    "Summarize the history of {t} in a few sentences.",
    "What should a beginner know about {t}?",
    "Give me some tips related to {t}.",
    "Write a short paragraph about {t}.",
    "How does {t} affect everyday life?",
    "List five key ideas about {t}.",
    "Compare {t} and {u}.",
    "What is the connection between {t} and {u}?",
]

CODE_TASKS = [
    "reverses a list without using built-in functions", "counts the vowels in a string",
    "finds the largest number in a list", "removes duplicates from a list while keeping order",
    "checks whether a number is prime", "computes the factorial of a number",
    "merges two sorted lists", "sorts a list of dictionaries by a key", "flattens a nested list",
    "counts word frequencies in a text", "converts Celsius to Fahrenheit",
    "finds the greatest common divisor of two numbers", "checks whether two strings are anagrams",
    "returns the second smallest element of a list", "computes the average of a list of numbers",
    "implements binary search", "implements bubble sort", "implements a stack class",
    "implements a queue using two stacks", "validates an email address with a regular expression",
    "reads a text file and counts its lines", "writes a dictionary to a JSON file",
    "generates a random password", "capitalizes the first letter of every word",
    "computes the sum of the digits of a number", "transposes a matrix", "finds all even numbers in a list",
    "converts a decimal number to binary", "checks whether a year is a leap year",
    "finds the longest word in a sentence", "rotates a list by k positions", "chunks a list into groups of n",
    "computes the median of a list", "counts the occurrences of each character in a string",
    "implements a simple linked list", "finds the intersection of two lists", "parses a date string",
    "measures how long a function takes to run", "downloads nothing but simulates a retry loop",
    "builds a dictionary from two lists", "calculates compound interest", "finds the mode of a list",
]

CODE_TEMPLATES = [
    "Write a Python function that {c}.",
    "How can I write a function in Python that {c}?",
    "Show me Python code that {c}, with comments.",
    "Write a JavaScript function that {c}.",
    "Write a short Python program that {c} and explain it.",
    "Can you give me an example of a Python function that {c}?",
]

CODE_QUESTIONS = [
    "What is the difference between a list and a tuple in Python?",
    "What does the `yield` keyword do in Python?",
    "Explain what a Python decorator is with an example.",
    "What is recursion? Give an example in Python.",
    "How do I handle exceptions in Python?",
    "What is the difference between `==` and `is` in Python?",
    "How do list comprehensions work in Python?",
    "What is a class in object-oriented programming?",
    "Explain Big O notation with examples.",
    "What is the difference between a process and a thread?",
    "How do I use a dictionary in Python?",
    "What is a lambda function in Python?",
    "How do I install a package with pip?",
    "What is Git and why do developers use it?",
    "Explain what an API is.",
    "What is SQL used for? Give a simple query as an example.",
    "How does a for loop work in Python?",
    "What are Python virtual environments?",
]

MATH_TEMPLATES = [
    "A box holds {a} apples. How many apples are in {b} boxes? Explain step by step.",
    "Tom has {a} marbles and gives {b} to his friend. How many does he have left?",
    "What is {a} multiplied by {b}? Show your work.",
    "What is {a} plus {b} plus {c}?",
    "A car travels {a} kilometers in {b} hours. What is its average speed?",
    "A rectangle is {a} meters long and {b} meters wide. What are its area and perimeter?",
    "If a shirt costs ${a} and is on sale for {p}% off, what is the sale price?",
    "What is {p}% of {a}? Explain how to compute it.",
    "Solve for x: {a}x + {b} = {c}.",
    "A class has {a} students. If {p}% of them are girls, how many boys are there?",
    "Sara reads {b} pages a day. How many days does she need to read a {a}-page book?",
    "What is the average of {a}, {b} and {c}?",
    "A recipe needs {b} eggs for {c} people. How many eggs are needed for {a} people?",
    "What is the square root of {sq}? Explain.",
    "Convert {a} minutes into hours and minutes.",
    "A triangle has sides {b}, {c} and {a}. What is its perimeter?",
    "If I save ${b} every week, how much will I have after {a} weeks?",
    "What is {a} divided by {b}? Give the answer with a remainder.",
    "A pizza is cut into {b} slices and {c} people share it equally. How many slices does each get?",
    "Is {a} a prime number? Explain why or why not.",
]

STORY_CHARACTERS = [
    "a lonely lighthouse keeper", "a curious fox", "a young wizard", "an old fisherman", "a lost puppy",
    "a clever girl named Maya", "a dragon who is afraid of fire", "a time traveler", "a tiny snail",
    "a retired astronaut", "a baker in a small village", "a talking tree", "a shy giant", "a pirate captain",
    "two best friends", "a family of rabbits", "a detective cat", "a knight without a horse",
    "a girl who can talk to birds", "a boy who builds kites", "a grumpy troll", "a friendly ghost",
    "an explorer in the jungle", "a musician on the street", "a farmer and his goat", "a penguin in the desert",
]
STORY_EVENTS = [
    "finds a mysterious map", "loses something precious", "makes an unlikely friend", "goes on a long journey",
    "discovers a hidden door", "has to save the village", "learns an important lesson", "enters a contest",
    "gets lost in a storm", "finds a magic stone", "meets a stranger at night", "tries something new",
    "helps a friend in trouble", "wakes up in a different world", "builds something amazing",
]
STORY_TEMPLATES = [
    "Write a short story about {x} who {e}.",
    "Tell me a story about {x} who {e}.",
    "Write a children's story about {x} who {e}.",
    "Write a funny story about {x}.",
    "Write a short poem about {t}.",
    "Write a haiku about {t}.",
    "Write the opening paragraph of a novel about {x}.",
    "Describe a day in the life of {x}.",
]

EDIT_TEMPLATES = [
    "Write a short email to my manager asking for a day off next week.",
    "Write a thank-you note to a teacher.",
    "Write a product description for a reusable water bottle.",
    "Write a short speech for a friend's birthday party.",
    "Give me a weekly workout plan for a beginner.",
    "Give me a simple recipe for a vegetable soup.",
    "Write a cover letter for a junior web developer position.",
    "Write a short review of a fictional restaurant.",
    "Write an invitation to a neighborhood picnic.",
    "Give me a packing list for a weekend camping trip.",
    "Write a motivational message for someone starting a new job.",
    "Write a short advertisement for a bicycle repair shop.",
]

# Subjects of the default evaluation prompts (ddtree/data/prompts.jsonl): never trained on.
HELD_OUT_PHRASES = [
    "focused while working from home", "working from home", "weather and climate", "trip to japan",
    "cats purr", "palindrome", "fibonacci", "csv", "pencils", "area of a circle", "60 miles per hour",
    "robot who learns to paint", "brave little mouse", "ocean at night",
]


def _stdlib_snippets(rng: random.Random, n: int, max_lines: int = 18) -> list[str]:
    """Short function definitions taken from Python's standard library source."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [p for p in root.glob("*.py") if not p.name.startswith("_")]
    rng.shuffle(files)
    out: list[str] = []
    for f in files:
        try:
            src = f.read_text(encoding="utf-8")
        except Exception:
            continue
        for m in re.finditer(r"^def [a-z]\w*\(.*?(?=^\S|\Z)", src, flags=re.M | re.S):
            lines = m.group(0).rstrip().splitlines()
            if 4 <= len(lines) <= max_lines:
                out.append("\n".join(lines))
                break
        if len(out) >= n:
            break
    return out


def _is_held_out(text: str) -> bool:
    low = text.lower()
    return any(p in low for p in HELD_OUT_PHRASES)


def training_prompts(n: int = 4000, seed: int = 0) -> list[str]:
    """``n`` distinct single-turn user prompts across chat, code, math, story and writing tasks."""
    rng = random.Random(seed)
    pool: list[str] = []
    for t in CHAT_TOPICS:
        for tmpl in CHAT_TASKS:
            u = rng.choice([x for x in CHAT_TOPICS if x != t])
            pool.append(tmpl.format(t=t, u=u))
    for c in CODE_TASKS:
        for tmpl in CODE_TEMPLATES:
            pool.append(tmpl.format(c=c))
    pool += CODE_QUESTIONS + EDIT_TEMPLATES
    for snip in _stdlib_snippets(rng, 150):
        pool.append(rng.choice([
            "Explain what this Python function does:\n```python\n{s}\n```",
            "Add comments to this Python code:\n```python\n{s}\n```",
            "Can you explain this code step by step?\n```python\n{s}\n```",
        ]).format(s=snip))
    for _ in range(900):
        a, b, c = rng.randint(12, 480), rng.randint(2, 24), rng.randint(3, 60)
        pool.append(rng.choice(MATH_TEMPLATES).format(
            a=a, b=b, c=c, p=rng.choice([5, 10, 15, 20, 25, 30, 40, 50, 75]), sq=rng.randint(2, 30) ** 2))
    for x in STORY_CHARACTERS:
        for e in STORY_EVENTS:
            pool.append(rng.choice(STORY_TEMPLATES).format(x=x, e=e, t=rng.choice(CHAT_TOPICS)))
    seen: set[str] = set()
    uniq = []
    for p in pool:
        if p not in seen and not _is_held_out(p):
            seen.add(p)
            uniq.append(p)
    rng.shuffle(uniq)
    return uniq[:n]


def load_eval_prompts() -> list[dict]:
    """The default evaluation prompt set shipped as ``ddtree/data/prompts.jsonl``."""
    path = Path(__file__).resolve().parent.parent / "data" / "prompts.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
