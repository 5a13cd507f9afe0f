"""Code prompts assembled here from task templates (never HumanEval): a training source for
the code domain, and HumanEval-shaped stubs (a signature and a docstring to complete) from the
Python standard library's own source, from the pure-Python libraries every install of
torch brings along, and from the larger packages dflash's own install brings (matplotlib,
pandas, rich, ...; then transformers, scipy, pytest, ...). Deterministic: the same seed (and the same installed versions) gives the
same list."""

from __future__ import annotations

import ast
import random
import sysconfig
from pathlib import Path

TASKS = [
    "reverse the words in a sentence", "check whether a string is a palindrome", "count the vowels in a string",
    "return the n-th Fibonacci number", "merge two sorted lists into one sorted list", "remove duplicates from a list while keeping order",
    "find the second largest number in a list", "compute the factorial of n iteratively", "flatten a nested list",
    "transpose a matrix given as a list of lists", "check whether a number is prime", "return all primes below n",
    "compute the greatest common divisor of two integers", "convert a Roman numeral to an integer", "convert an integer to binary without using bin()",
    "group words that are anagrams of each other", "find the longest common prefix of a list of strings", "rotate a list by k positions",
    "compute the running sum of a list", "count word frequencies in a text", "validate balanced parentheses in a string",
    "implement binary search on a sorted list", "implement bubble sort", "implement merge sort", "implement quicksort",
    "find the maximum subarray sum", "compute the dot product of two vectors", "parse a CSV line into fields",
    "capitalize the first letter of every word", "find the index of the first non-repeating character", "check whether two strings are anagrams",
    "compute the median of a list of numbers", "chunk a list into pieces of size n", "compute the Levenshtein distance between two strings",
    "convert Celsius to Fahrenheit for a list of temperatures", "return the digits of an integer as a list", "sum the digits of an integer",
    "find all pairs in a list that sum to a target", "implement a stack class with push, pop and peek", "implement a queue using two stacks",
    "implement an LRU cache", "read a text file and count its lines", "compute the mean and standard deviation of a list",
    "find the most common element in a list", "check whether a year is a leap year", "compute compound interest",
    "generate Pascal's triangle up to n rows", "compress a string with run-length encoding", "decode a run-length encoded string",
    "find the intersection of two lists", "check whether a list is sorted", "interleave two lists", "compute the power set of a set",
    "generate all permutations of a string", "count the islands in a grid of 0s and 1s", "compute the area of a polygon from its vertices",
    "convert a snake_case string to camelCase", "truncate a string to n characters with an ellipsis", "validate an email address with a regular expression",
    "find the k largest elements of a list", "implement a linked list with insert and delete", "reverse a linked list",
    "compute the depth of a binary tree", "do an in-order traversal of a binary tree", "serialize a dictionary to a query string",
    "compute the number of days between two dates", "find missing numbers in a range", "check whether a Sudoku row is valid",
    "simulate rolling two dice many times and report frequencies", "implement FizzBuzz", "compute the triangle number of n",
]
LANGUAGES = ["Python", "Python", "Python", "JavaScript", "C++", "Java", "Go", "Rust", "TypeScript", "C"]
STYLES = [
    "Write a {lang} function to {task}.",
    "Write a {lang} function that can {task}. Include a short docstring or comment.",
    "How do I {task} in {lang}? Show the code.",
    "Implement a program in {lang} to {task}, and explain how it works.",
    "Give me an efficient {lang} solution to {task}, with an example call.",
    "Write {lang} code to {task} and add a few test cases.",
    "Can you show me a simple way to {task} using {lang}?",
    "Explain the time complexity of a {lang} function that will {task}, and write it.",
]


# added after the 6 000-prompt lists had used nearly all combinations of TASKS;
# read only after every TASKS combination, so the earlier lists (and the kept responses of
# data/smollm2-b) keep their prompts
MORE_TASKS = [
    "parse a JSON string and print one of its fields", "write a class for a bank account with deposit and withdraw",
    "count the lines, words and characters of a file", "find duplicate files in a folder by their hash",
    "implement a trie with insert and search", "implement a min-heap with push and pop", "implement Dijkstra's shortest path",
    "do a breadth-first search on a graph given as an adjacency list", "detect a cycle in a directed graph",
    "compute a topological order of tasks with dependencies", "solve the 0/1 knapsack problem with dynamic programming",
    "find the longest increasing subsequence", "compute the edit operations between two lists", "implement matrix multiplication",
    "compute the determinant of a 3x3 matrix", "check whether a string is a valid IPv4 address", "convert a number to words in English",
    "format a number of seconds as hours, minutes and seconds", "split a list into two halves by a predicate",
    "zip two lists into a dictionary", "invert a dictionary whose values are unique", "merge two dictionaries summing common keys",
    "sort a list of dictionaries by a key", "find the longest palindromic substring", "count the set bits of an integer",
    "compute the Collatz sequence of a number", "generate random passwords of a given length", "shuffle a list with Fisher-Yates",
    "implement a simple tokenizer for arithmetic expressions", "evaluate an arithmetic expression in reverse Polish notation",
    "implement a binary search tree with insert and find", "find the lowest common ancestor in a binary tree",
    "check whether a binary tree is balanced", "print a binary tree level by level", "implement a circular buffer",
    "retry a function call with exponential backoff", "memoize a recursive function", "read a CSV file and average one column",
    "write a command-line argument parser for two options", "compute the moving average of a stream of numbers",
    "find the majority element of a list", "rotate a square matrix by 90 degrees", "spiral-order traverse a matrix",
    "count the paths in a grid moving right and down", "compute the minimum coins needed for an amount",
    "check whether a number is an Armstrong number", "convert between hexadecimal strings and integers",
    "calculate the angle between the hands of a clock", "validate a credit card number with the Luhn algorithm",
    "implement a simple rate limiter", "merge overlapping intervals", "find the k-th smallest element with quickselect",
]


def _combos(tasks: list[str], rng: random.Random) -> list[tuple[str, str, str]]:
    combos = [(t, l, s) for t in tasks for l in sorted(set(LANGUAGES)) for s in STYLES]
    rng.shuffle(combos)
    return combos


def code_prompts(n: int = 2000, seed: int = 0) -> list[tuple[str, str]]:
    """(id, user message) pairs, distinct, in a seeded order: every TASKS combination first,
    then MORE_TASKS (so a longer list keeps a shorter one as its prefix)."""
    weights = {l: LANGUAGES.count(l) for l in set(LANGUAGES)}
    out, seen = [], set()
    rng, rng_more = random.Random(seed), random.Random(seed + 1)
    for combos, r in ((_combos(TASKS, rng), rng), (_combos(MORE_TASKS, rng_more), rng_more)):
        for t, l, s in combos:
            # prefer Python: keep every Python combo, sample the others
            if l != "Python" and r.random() > weights[l] / 3:
                continue
            text = s.format(lang=l, task=t)
            if text not in seen:
                seen.add(text)
                out.append((f"code-{len(out)}", text))
            if len(out) >= n:
                return out
    return out


# ---- HumanEval-shaped prompts from the standard library's own source ------------------------

MAX_BODY_LINES = 12  # "a short body": the statements after the docstring, as ast.unparse writes them


def docstring_functions(root: str | Path | None = None, methods: bool = False,
                        prefix: str = "stdlib/", private_modules: bool = False) -> list[tuple[str, str]]:
    """(id, signature + docstring) of every module-level function in the Python standard
    library (`root`: default sysconfig's stdlib) that has a docstring and a short body, in
    file order: the shape of a HumanEval task (a signature and a docstring to complete), from
    a source that cannot overlap HumanEval (the leak check in data.py tests that too). Test
    suites, private modules, idlelib, turtledemo and site-packages are skipped; the body is
    never shown. `methods`: the public methods of public module-level classes instead, each
    shown inside a bare `class Name:` line, the docstring indented as written. `prefix`
    starts every id (a package's name and a dot when `root` is a package folder).
    `private_modules`: read `_name` modules and folders too (where packages such as scipy and
    httpx keep the public functions they re-export); private names stay out either way."""
    root = Path(root or sysconfig.get_paths()["stdlib"])
    out, seen = [], set()
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        private = not private_modules and any(p.startswith("_") and p != "__init__.py" for p in rel.parts)
        if private or rel.parts[0] in SKIP_DIRS or any(p.startswith("test") for p in rel.parts):
            continue
        try:
            tree = ast.parse(path.read_text(encoding="utf-8"))
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        module = ".".join(rel.with_suffix("").parts)
        for name, stub in (_method_stubs(tree) if methods else _function_stubs(tree)):
            if stub not in seen:  # a function copied into two modules counts once
                seen.add(stub)
                out.append((f"{prefix}{module}.{name}", stub))
    return out


# torch's own pure-Python dependencies (mpmath comes with sympy): on every machine dflash runs
LIBRARIES = ("sympy", "mpmath", "networkx", "jinja2")
# the next pool (the `package` source, once LIBRARIES was spent): pure-Python
# packages `make test` installs beside dflash (its bench, data, serve and test extras and their
# own dependencies), ~3.8 K stubs; transformers would add ~4 K more but takes minutes to parse
PACKAGES = ("matplotlib", "pandas", "fontTools", "rich", "PIL", "numpy", "setuptools", "huggingface_hub",
            "fsspec", "openpyxl", "click", "pygments", "packaging")


def library_functions(libraries: tuple[str, ...] = LIBRARIES, private_modules: bool = False) -> list[tuple[str, str]]:
    """The stubs of `docstring_functions`, functions and class methods both, from the installed
    `libraries` instead of the standard library: ids `lib/<package>.<module>.<name>`, one stub
    text once. A library that is not installed adds nothing. `private_modules`: as in
    `docstring_functions`."""
    import importlib.util

    out, seen = [], set()
    for lib in libraries:
        spec = importlib.util.find_spec(lib)
        if spec is None or not spec.submodule_search_locations:
            continue
        root = Path(next(iter(spec.submodule_search_locations)))
        for methods in (False, True):
            for pid, stub in docstring_functions(root, methods, f"lib/{lib}.", private_modules):
                if stub not in seen:
                    seen.add(stub)
                    out.append((pid, stub))
    return out


# the fourth pool (the `package2` source, once PACKAGES was spent): more packages
# `make test` installs, transformers (dflash's own dependency) first; read with their private
# modules (scipy, httpx and pytest keep public functions in `_name` modules). ~4 K stubs after
# MAX_PER_NAME: transformers alone repeats `forward` 701 times, one per model
MORE_PACKAGES = ("transformers", "scipy", "_pytest", "pydantic", "werkzeug", "flask", "prompt_toolkit", "aiohttp",
                 "httpx", "anyio", "pyparsing", "requests", "urllib3", "markdown_it", "tomlkit", "dateutil",
                 "uvicorn", "fastapi", "mlx_lm", "yaml", "jsonschema", "pluggy", "httpcore", "typer", "starlette")
MAX_PER_NAME = 3


def more_package_functions(packages: tuple[str, ...] = MORE_PACKAGES,
                           max_per_name: int = MAX_PER_NAME) -> list[tuple[str, str]]:
    """The `package2` pool: `library_functions` of `packages`, private modules read too, at most
    `max_per_name` stubs (the first in file order) for one function or method name."""
    count: dict[str, int] = {}
    out = []
    for pid, stub in library_functions(packages, private_modules=True):
        name = pid.rsplit(".", 1)[-1]
        count[name] = count.get(name, 0) + 1
        if count[name] <= max_per_name:
            out.append((pid, stub))
    return out


def _function_stubs(tree: ast.Module):
    for node in tree.body:
        stub = _stub(node)
        if stub is not None:
            yield node.name, _source(stub)


def _source(node: ast.stmt) -> str:
    return ast.unparse(ast.fix_missing_locations(ast.Module([node], []))) + "\n"


def _method_stubs(tree: ast.Module):
    for cls in tree.body:
        if isinstance(cls, ast.ClassDef) and not cls.name.startswith("_"):
            for node in cls.body:
                stub = _stub(node)
                if stub is not None:
                    shell = ast.ClassDef(name=cls.name, bases=[], keywords=[], body=[stub], decorator_list=[],
                                         type_params=[])
                    yield f"{cls.name}.{node.name}", _source(shell)


SKIP_DIRS = {"site-packages", "idlelib", "turtledemo", "lib2to3", "ensurepip", "pydoc_data", "tkinter"}


def _stub(node: ast.AST) -> ast.FunctionDef | None:
    """`def name(args) -> ret:` and its docstring, when `node` is a public function with a
    docstring of a few lines and a body of 1..MAX_BODY_LINES lines; else None."""
    if not isinstance(node, ast.FunctionDef) or node.name.startswith("_"):
        return None
    doc = ast.get_docstring(node, clean=True)
    if not doc or len(doc) < 40 or len(doc.splitlines()) > 25:
        return None
    body = node.body[1:]
    lines = sum(len(ast.unparse(s).splitlines()) for s in body)
    if not 1 <= lines <= MAX_BODY_LINES:
        return None
    raw = ast.get_docstring(node, clean=False)  # as written, indented like the source (and HumanEval)
    return ast.FunctionDef(name=node.name, args=node.args, body=[ast.Expr(ast.Constant(raw))], decorator_list=[],
                           returns=node.returns)


def docstring_prompts(n: int = 2000, seed: int = 0, root: str | Path | None = None,
                      methods: bool = False, libraries: tuple[str, ...] = (),
                      pool: list[tuple[str, str]] | None = None) -> list[tuple[str, str]]:
    """(id, user message) pairs: `n` standard-library stubs (functions, or with `methods` class
    methods; with `libraries`, e.g. LIBRARIES or PACKAGES, both from those packages instead) in
    a seeded order, each asked as the benchmark asks HumanEval (the same instruction, the stub
    in a Python code block). `pool`: the (id, stub) pairs to draw from, as `docstring_functions`
    or `library_functions` returned them (then root, methods and libraries are not read:
    nothing is parsed again)."""
    from dflash.text.prompts import _HUMANEVAL_INSTRUCTION

    if pool is not None:
        stubs = list(pool)
    else:
        stubs = library_functions(libraries) if libraries else docstring_functions(root, methods)
    random.Random(seed).shuffle(stubs)
    return [(i, f"{_HUMANEVAL_INSTRUCTION}```python\n{code}```") for i, code in stubs[:n]]
