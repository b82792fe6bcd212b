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
    "sky is blue",  # the demo's prompt
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


# A second, differently phrased prompt set ("natural"): first-person requests with some context,
# how-to questions, explanations of everyday things, code questions as people ask them, word
# problems with other shapes, and stories, poems and letters with other subjects. It varies the
# training data beyond the templates above; the evaluation subjects stay excluded.
GOALS = [
    "sleep better", "wake up earlier", "learn to cook", "save for a house", "get better at math", "make new friends",
    "start running", "learn to draw", "drink more water", "stop procrastinating", "remember names",
    "prepare for a job interview", "write a good resume", "keep my apartment tidy", "grow tomatoes on a balcony",
    "learn to swim", "improve my handwriting", "read faster", "speak more confidently", "reduce screen time",
    "train a puppy", "take care of a cat", "plan a birthday party", "organize my closet", "study for exams",
    "learn to code", "build a personal website", "learn Spanish", "lose weight safely", "eat more vegetables",
    "get along with my roommate", "deal with a difficult coworker", "negotiate a raise", "ask for feedback",
    "start a podcast", "take better photos with my phone", "write a short story", "keep a journal",
    "learn chess openings", "choose a laptop", "set up a home network", "protect my passwords",
    "clean a cast iron pan", "make sourdough bread", "brew good tea", "plan a road trip", "pack for a flight",
    "stay motivated at the gym", "recover after a long run", "stretch properly", "fall asleep faster",
]
THINGS = [
    "a refrigerator", "a microwave oven", "a rainbow", "a compass", "a vaccine", "a credit card", "a bicycle gear",
    "a thermostat", "a touchscreen", "wifi", "a search engine", "an airplane wing", "a submarine", "a volcano",
    "the heart", "the lungs", "a battery", "a light bulb", "a solar panel", "an electric motor", "a camera",
    "a clock", "a piano", "a bee hive", "a tree's roots", "a tide clock", "a hurricane", "lightning", "a glacier",
    "a 3D printer", "a hard drive", "an elevator", "a traffic light", "a dishwasher", "a compost pile",
    "the postal system", "a bank loan", "a library catalog", "a spreadsheet", "an email server", "a password manager",
]
PAIRS = [
    ("a virus", "a bacterium"), ("a lake", "a pond"), ("speed", "velocity"), ("a crocodile", "an alligator"),
    ("baking soda", "baking powder"), ("RAM", "storage"), ("a meteor", "a meteorite"), ("an ape", "a monkey"),
    ("a loan", "a grant"), ("socialism", "capitalism"), ("a simile", "a metaphor"), ("a frog", "a toad"),
    ("affect", "effect"), ("a hurricane", "a tornado"), ("mass", "weight"), ("HTTP", "HTTPS"),
    ("a compiler", "an interpreter"), ("stocks", "bonds"), ("a democracy", "a republic"), ("jam", "jelly"),
    ("a mile", "a kilometer"), ("a bug", "an insect"), ("a star", "a planet"), ("an atom", "a molecule"),
    ("Python", "JavaScript"), ("a laptop", "a tablet"), ("yoga", "pilates"), ("a cold", "the flu"),
]
SITUATIONS = [
    "starting university next month", "moving to a new city", "adopting a dog for the first time",
    "about to run my first 10k race", "starting my first job as a nurse", "learning to play the piano at 40",
    "planning a camping trip with kids", "hosting a dinner for eight people", "buying my first car",
    "writing my first novel", "switching careers into data science", "visiting Paris for three days",
    "building a garden bed", "teaching my kid to ride a bike", "preparing a presentation for my team",
    "going on a week-long hiking trip", "renting my first apartment", "learning to bake cakes",
]
ANIMAL_FACTS = [
    ("dogs", "wag their tails"), ("birds", "sing in the morning"), ("bees", "make honey"), ("owls", "hunt at night"),
    ("zebras", "have stripes"), ("leaves", "change color in autumn"), ("fish", "swim in schools"),
    ("camels", "have humps"), ("bats", "hang upside down"), ("salmon", "swim upstream"), ("geese", "fly in a V"),
    ("giraffes", "have long necks"), ("snakes", "shed their skin"), ("whales", "sing"), ("ants", "form lines"),
    ("onions", "make us cry"), ("we", "yawn"), ("we", "dream"), ("cats", "knead blankets"),
]
CODE_ASKS = [
    "sort a dictionary by its values", "reverse a string", "remove whitespace from a string", "merge two dictionaries",
    "read a text file line by line", "check if a key exists in a dictionary", "count items in a list",
    "find the index of an element in a list", "split a string into words", "convert a string to an integer",
    "get the current date and time", "make an HTTP request", "create a virtual environment", "write unit tests",
    "format a number with two decimals", "loop over a dictionary", "sum a list of numbers", "shuffle a list",
    "pick a random element from a list", "copy a list", "join a list of strings", "check the type of a variable",
    "handle a missing file", "parse JSON", "use a set to remove duplicates", "use enumerate in a loop",
    "sort a list of tuples by the second item", "define a class with a constructor", "use f-strings",
    "write a while loop that stops on user input", "use zip to combine two lists", "find the max of a dictionary",
]
CODE_FUNCS = [
    "returns the number of words in a sentence", "checks whether a list is sorted",
    "returns the sum of squares up to n",
    "converts a list of strings to uppercase", "finds the smallest number in a list",
    "counts the uppercase letters in a string",
    "returns True if a number is even", "computes the power of a number without using **", "swaps two variables",
    "returns the last n elements of a list", "checks whether a string contains only digits", "computes a running total",
    "removes all vowels from a string", "groups words by their first letter", "finds the first repeated character",
    "returns the distance between two points", "converts hours to seconds", "computes the area of a rectangle",
    "prints a multiplication table", "counts how many times a word appears in a text",
    "returns the nth triangular number",
    "checks whether all elements of a list are unique", "returns a list of prime numbers below n",
    "reverses the words in a sentence",
    "computes the dot product of two vectors", "converts a Roman numeral to an integer",
    "finds the missing number in a range",
]
POEM_SUBJECTS = [
    "autumn leaves", "a rainy morning", "the mountains", "a city at dawn", "an old house", "friendship",
    "the desert wind",
    "a summer garden", "the first snow", "a cup of coffee", "the stars", "a busy train station", "a quiet forest",
    "a river", "growing up", "a lighthouse", "the moon", "a field of sunflowers", "a thunderstorm", "a small boat",
]
STORY_SUBJECTS = [
    "a girl who finds a key in the sand", "a cat who wants to fly", "a boy and his grandfather fixing a clock",
    "a village where it never stops raining", "a dragon who loves books", "a squirrel preparing for winter",
    "a lost balloon", "a kind giant and a small town", "a turtle who wants to win a race", "an owl who cannot sleep",
    "a magic paintbrush", "a spaceship crew far from home", "a teddy bear left at a train station",
    "a princess who becomes an inventor", "a little cloud", "a shy elephant at school", "a dog who finds his way home",
    "two friends building a treehouse", "a baker who bakes a cake for the moon", "a frog who wants to sing",
]
NATURAL_CHAT = [
    "What are some good ways to {g}?", "How can I {g}?", "I want to {g}. Where do I start?",
    "Do you have any tips to help me {g}?", "What's the best way to {g}?", "Give me a simple plan to {g}.",
]
NATURAL_OTHER = [
    "How does {th} work?", "Can you explain how {th} works?", "What is inside {th}?",
]
MATH_NATURAL = [
    "A bakery sells muffins at {b} for ${c}. How much do {a} muffins cost? Explain step by step.",
    "What is the perimeter of a square with sides of {b} cm? Show your work.",
    "If a cyclist rides at {b} km per hour for {c} hours, how far does she go?",
    "A tank holds {a} liters and drains {b} liters per minute. How long until it is empty?",
    "What is the volume of a cube with edges of {b} cm? Show your work.",
    "Lisa earns ${a} a week and spends {p}% of it on rent. How much is left?",
    "A movie starts at 7:15 pm and lasts {a} minutes. When does it end?",
    "If {b} workers build a wall in {c} days, how long do {d} workers need?",
    "What is the circumference of a circle with a diameter of {b} meters? Show your work.",
    "A store has {a} books and sells {b} each day. How many are left after {c} days?",
    "What is {b} squared plus {c} squared?", "Round {x} to the nearest tenth and explain.",
    "What fraction of {a} is {b}? Simplify it.", "A bus leaves every {b} minutes. How many buses leave in {c} hours?",
]


def natural_prompts(n: int = 4000, seed: int = 1) -> list[str]:
    """``n`` distinct prompts of the second ("natural") set; disjoint from the evaluation subjects."""
    rng = random.Random(seed)
    pool: list[str] = []
    pool += [t.format(g=g) for g in GOALS for t in NATURAL_CHAT]
    pool += [t.format(th=th) for th in THINGS for t in NATURAL_OTHER]
    pool += [f"Can you explain the difference between {a} and {b}?" for a, b in PAIRS]
    pool += [f"What is the difference between {a} and {b}? Keep it short." for a, b in PAIRS]
    pool += [f"I am {s}. What should I know before I start?" for s in SITUATIONS]
    pool += [f"I'm {s} and I feel nervous. Any advice?" for s in SITUATIONS]
    pool += [f"Why do {a} {b}?" for a, b in ANIMAL_FACTS]
    pool += [f"How do I {c} in Python?" for c in CODE_ASKS]
    pool += [f"In Python, what is the easiest way to {c}? Show an example." for c in CODE_ASKS]
    pool += [f"Write a Python function that {c}." for c in CODE_FUNCS]
    pool += [f"Write a Python function that {c}, and explain how it works." for c in CODE_FUNCS]
    pool += [f"Write a function in JavaScript that {c}." for c in CODE_FUNCS]
    for _ in range(700):
        a, b, c, d = rng.randint(20, 600), rng.randint(2, 30), rng.randint(2, 12), rng.randint(2, 20)
        pool.append(rng.choice(MATH_NATURAL).format(a=a, b=b, c=c, d=d, p=rng.choice([10, 20, 25, 30, 40]),
                                                    x=round(rng.uniform(1, 100), 2)))
    for s in POEM_SUBJECTS:
        pool += [f"Write a short poem about {s}.", f"Write a haiku about {s}.", f"Write a limerick about {s}."]
    for s in STORY_SUBJECTS:
        pool += [f"Write a short story about {s}.", f"Tell me a bedtime story about {s}.",
                 f"Write a story for children about {s}, with a happy ending."]
    seen: set[str] = set()
    uniq = [p for p in pool if not (p in seen or seen.add(p)) and not _is_held_out(p)]
    rng.shuffle(uniq)
    return uniq[:n]
