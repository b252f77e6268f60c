"""The built-in calibration set: short chats on everyday topics, written for this project.

Pruning ranks channels by how strongly ordinary text drives them; a few thousand tokens of varied prose, code and
arithmetic are enough for that (Minitron calibrates on 1,024 samples, and rankings settle with far fewer). A file of
the run's own prompts (``--calibration``) is the better choice whenever one exists.
"""

BUILTIN_RECORDS: tuple[dict[str, str], ...] = (
    {"prompt": "Why is the sky blue?",
     "response": "Sunlight contains every colour. As it passes through the air, it bounces off nitrogen and oxygen "
                 "molecules, and short wavelengths scatter far more strongly than long ones. Blue light is scattered "
                 "across the whole sky, so wherever you look away from the sun, some of that scattered blue reaches "
                 "your eyes. At sunrise and sunset the light crosses much more air, most of the blue is scattered "
                 "away before it arrives, and the remaining reds and oranges dominate."},
    {"prompt": "Write a Python function that returns the n-th Fibonacci number.",
     "response": "Here is an iterative version that runs in linear time and constant memory:\n\n```python\n"
                 "def fibonacci(n: int) -> int:\n    if n < 0:\n        raise ValueError(\"n must be non-negative\")\n"
                 "    a, b = 0, 1\n    for _ in range(n):\n        a, b = b, a + b\n    return a\n```\n\n"
                 "For example, `fibonacci(10)` returns 55. A recursive version is shorter but takes exponential "
                 "time unless you cache its results."},
    {"prompt": "What is 17 multiplied by 24? Show your steps.",
     "response": "Split 24 into 20 and 4. First, 17 x 20 = 340. Then, 17 x 4 = 68. Adding the two parts gives "
                 "340 + 68 = 408. So 17 multiplied by 24 is 408."},
    {"prompt": "Give me three tips for sleeping better.",
     "response": "1. Keep a regular schedule: go to bed and get up at the same time every day, weekends included.\n"
                 "2. Make the bedroom dark, quiet and cool, and keep screens out of it for the last hour before "
                 "sleep.\n3. Avoid caffeine after lunch and heavy meals late in the evening. If you cannot fall "
                 "asleep after twenty minutes, get up and read something calm until you feel sleepy."},
    {"prompt": "Explain what a hash table is.",
     "response": "A hash table stores key-value pairs in an array. A hash function turns each key into an index, "
                 "so looking up, inserting or deleting a key usually takes constant time. Two keys can land on "
                 "the same index, which is called a collision; tables resolve it by keeping a small list at each "
                 "slot or by probing for the next free slot. When the table fills up, it grows and re-inserts "
                 "every entry so that lookups stay fast."},
    {"prompt": "Summarise the water cycle for a ten-year-old.",
     "response": "The sun warms oceans, lakes and rivers, and some of the water turns into invisible vapour that "
                 "rises into the sky. High up it cools down and forms tiny droplets, which gather into clouds. "
                 "When the droplets get big and heavy, they fall as rain or snow. The water runs into rivers, "
                 "soaks into the ground or flows back to the sea, and then the whole journey starts again."},
    {"prompt": "How do I make a simple tomato sauce?",
     "response": "Warm two tablespoons of olive oil in a pan and gently cook a chopped onion for about eight "
                 "minutes, until soft. Add two sliced cloves of garlic for one more minute. Pour in a can of "
                 "crushed tomatoes, add a pinch of salt and a little sugar, and let it simmer for twenty minutes, "
                 "stirring now and then. Finish with fresh basil and a spoon of butter or a splash of olive oil."},
    {"prompt": "What caused the fall of the Western Roman Empire?",
     "response": "Historians point to several causes working together rather than a single one. The empire faced "
                 "repeated civil wars and weak central government in the third century, a shrinking tax base and "
                 "debased currency, and growing pressure from migrating peoples along the Rhine and Danube. It "
                 "came to rely on Germanic soldiers and commanders, and in 476 the general Odoacer deposed the "
                 "last western emperor, Romulus Augustulus. The eastern half survived for another thousand years."},
    {"prompt": "Translate into French: The library opens at nine in the morning.",
     "response": "La bibliotheque ouvre a neuf heures du matin."},
    {"prompt": "What is the difference between a list and a tuple in Python?",
     "response": "Both hold ordered sequences of items. A list is mutable: you can append, remove or change items "
                 "after creating it. A tuple is immutable: once built, it cannot change, which makes it hashable "
                 "when its items are, so it can serve as a dictionary key or a set member. Use a list for a "
                 "collection that grows or changes, and a tuple for a fixed record such as a pair of coordinates."},
    {"prompt": "A train travels 180 kilometres in 2 hours and 15 minutes. What is its average speed?",
     "response": "Two hours and fifteen minutes is 2.25 hours. Average speed is distance divided by time: "
                 "180 / 2.25 = 80. The train's average speed is 80 kilometres per hour."},
    {"prompt": "Write a short poem about autumn.",
     "response": "The maples blush in amber light,\nthe mornings taste of frost and smoke,\ngeese stitch the sky "
                 "in patient flight,\nand every path wears a golden cloak.\nThe garden sighs and goes to sleep,\n"
                 "its secrets buried, safe and deep."},
    {"prompt": "How does a vaccine train the immune system?",
     "response": "A vaccine shows the immune system a harmless piece or version of a germ, such as a surface "
                 "protein or an inactivated virus. Immune cells learn to recognise it, produce antibodies against "
                 "it, and keep memory cells that remember its shape. If the real germ arrives later, those memory "
                 "cells respond within days instead of weeks, often stopping the infection before it causes "
                 "serious illness."},
    {"prompt": "Suggest a name for a small bakery by the sea.",
     "response": "A few ideas: \"Salt and Crumb\", \"The Tide Loaf\", \"Harbour Oven\", \"Seaside Sourdough\" or "
                 "\"The Driftwood Bakehouse\". Pick one that is easy to say aloud and still fits if you later sell "
                 "coffee or cakes as well."},
    {"prompt": "What does the SQL JOIN clause do?",
     "response": "A JOIN combines rows from two tables on a related column. An INNER JOIN keeps only rows that have "
                 "a match in both tables. A LEFT JOIN keeps every row of the left table and fills the right side "
                 "with NULL where nothing matches; a RIGHT JOIN does the opposite. For example, joining orders to "
                 "customers on customer_id lists each order together with the name of the customer who placed it."},
    {"prompt": "Is it better to rent or buy a home?",
     "response": "It depends on how long you plan to stay, local prices and your finances. Buying builds equity and "
                 "protects you from rising rents, but it ties up savings in a deposit and brings costs such as "
                 "taxes, insurance and repairs. Renting is flexible and cheaper to start, and the money you do not "
                 "put into a deposit can be invested. A common rule of thumb is that buying pays off if you stay "
                 "at least five to seven years."},
    {"prompt": "Explain photosynthesis in two sentences.",
     "response": "Plants capture sunlight with chlorophyll and use its energy to turn carbon dioxide from the air and "
                 "water from the soil into glucose. Oxygen is released as a by-product, and the glucose fuels the "
                 "plant's growth."},
    {"prompt": "Write a bash command that counts the lines of every .txt file in a folder.",
     "response": "Use `wc` with a glob:\n\n```bash\nwc -l /path/to/folder/*.txt\n```\n\nIt prints the line count of "
                 "each file followed by a total. To include subfolders, combine it with find: "
                 "`find /path/to/folder -name '*.txt' -exec wc -l {} +`."},
    {"prompt": "What are prime numbers?",
     "response": "A prime number is a whole number greater than 1 whose only divisors are 1 and itself. The first "
                 "few are 2, 3, 5, 7, 11 and 13. Every whole number greater than 1 can be written as a product of "
                 "primes in exactly one way, which is why primes are called the building blocks of arithmetic. "
                 "There are infinitely many of them, as Euclid proved more than two thousand years ago."},
    {"prompt": "My code says 'IndexError: list index out of range'. What does it mean?",
     "response": "It means your code asked for a position that the list does not have. A list of length n has "
                 "indices 0 to n - 1, so `items[n]` fails. Common causes are loops that run one step too far, "
                 "such as `for i in range(len(items) + 1)`, or reading from an empty list. Print the length and "
                 "the index just before the failing line to see which one is off."},
    {"prompt": "Describe the rules of chess in a few sentences.",
     "response": "Two players move sixteen pieces each on an eight by eight board, white first. Each kind of piece "
                 "moves in its own way: rooks in straight lines, bishops diagonally, the queen in both, knights in "
                 "an L shape, the king one square, and pawns forward, capturing diagonally. The goal is to "
                 "checkmate the opposing king, attacking it so that it has no legal way to escape."},
    {"prompt": "How can a small team improve its code reviews?",
     "response": "Keep changes small so that a review takes minutes, not hours. Agree on a short checklist, such as "
                 "tests, naming and error handling, and let automated linters catch formatting. Review within a "
                 "day so that work does not stall, ask questions rather than give orders, and explain the reason "
                 "behind each request. Finally, praise good solutions: reviews are also how a team learns."},
    {"prompt": "Convert 72 degrees Fahrenheit to Celsius.",
     "response": "Subtract 32 and multiply by five ninths: (72 - 32) x 5 / 9 = 40 x 5 / 9 = 22.2. So 72 degrees "
                 "Fahrenheit is about 22.2 degrees Celsius."},
    {"prompt": "Why do we have seasons?",
     "response": "Earth's axis is tilted by about 23.5 degrees relative to its orbit. For part of the year the "
                 "northern hemisphere leans towards the sun, receives more direct sunlight and longer days, and "
                 "has summer, while the southern hemisphere has winter. Six months later the situation reverses. "
                 "The small changes in Earth's distance from the sun matter far less than this tilt."},
    {"prompt": "How does a refrigerator keep food cold?",
     "response": "A refrigerator moves heat from the inside to the outside rather than making cold. A pump called the "
                 "compressor squeezes a refrigerant gas, which heats it up; the hot gas releases its heat through "
                 "the coils at the back and condenses into a liquid. The liquid then passes through a narrow valve, "
                 "expands and evaporates inside the fridge, absorbing heat from the food and the air around it. The "
                 "gas returns to the compressor and the cycle repeats, guided by a thermostat."},
    {"prompt": "Write a polite email asking a colleague to review my report by Friday.",
     "response": "Subject: Review of the quarterly report\n\nHi Sam,\n\nI have finished the first draft of the "
                 "quarterly report and would really value your feedback, especially on the budget section. Could "
                 "you take a look by Friday? It is about twelve pages, and comments directly in the document are "
                 "perfect. If Friday is difficult, just let me know and we can find another time.\n\nThanks a lot,"
                 "\nAlex"},
    {"prompt": "What is the Pythagorean theorem?",
     "response": "In a right triangle, the square of the hypotenuse, the side opposite the right angle, equals the "
                 "sum of the squares of the other two sides: a^2 + b^2 = c^2. For example, a triangle with legs of "
                 "3 and 4 has a hypotenuse of 5, because 9 + 16 = 25. Builders have long used this to check that "
                 "corners are square."},
    {"prompt": "Explain recursion with a simple example.",
     "response": "A recursive function solves a problem by calling itself on a smaller version of the same problem, "
                 "until it reaches a case simple enough to answer directly. The factorial is the classic example:\n"
                 "\n```python\ndef factorial(n):\n    if n <= 1:\n        return 1\n    return n * factorial(n - 1)"
                 "\n```\n\nCalling `factorial(4)` computes 4 x 3 x 2 x 1 = 24. Without the base case, the calls "
                 "would never stop."},
    {"prompt": "What should I pack for a weekend hiking trip?",
     "response": "Bring layers you can add or remove: a base layer that dries quickly, a warm fleece and a "
                 "waterproof jacket. Wear broken-in boots and pack spare socks. Carry enough water, a way to purify "
                 "more, and food that is light but filling, such as nuts, dried fruit and wraps. Add a map, a "
                 "headlamp, sunscreen, a small first-aid kit and a charged phone, and tell someone your route and "
                 "when you expect to return."},
    {"prompt": "Why do leaves change colour in autumn?",
     "response": "During the growing season, leaves are full of green chlorophyll, which hides other pigments. As "
                 "days shorten and nights cool, trees stop making chlorophyll and break it down to recover its "
                 "nutrients. The yellow and orange carotenoids that were there all along become visible, and some "
                 "trees also produce red anthocyanins from the sugars trapped in their leaves."},
    {"prompt": "Solve for x: 3x + 7 = 22.",
     "response": "Subtract 7 from both sides: 3x = 15. Then divide both sides by 3: x = 5. Check: 3 x 5 + 7 = "
                 "15 + 7 = 22, so x = 5 is correct."},
    {"prompt": "What is the difference between weather and climate?",
     "response": "Weather is what the atmosphere does over hours or days: today's rain, tomorrow's wind, this "
                 "week's heat. Climate is the pattern of weather in a region over decades, such as its average "
                 "temperatures, how much rain falls in each season and how often storms occur. A cold day does not "
                 "disprove a warming climate, just as one sunny day does not make a desert."},
    {"prompt": "Give me a short explanation of how the internet routes data.",
     "response": "Data is split into small packets, each labelled with the address of its destination. Routers "
                 "along the way read that address and pass each packet to a neighbour that is closer to the "
                 "destination, using routing tables they share with one another. Packets of one message may take "
                 "different paths and arrive out of order; the receiving computer puts them back together and asks "
                 "again for any that went missing."},
    {"prompt": "How do I keep a houseplant healthy?",
     "response": "Find out how much light your plant likes and place it accordingly; most common houseplants prefer "
                 "bright, indirect light. Water when the top few centimetres of soil feel dry, and empty any water "
                 "left in the saucer so the roots do not rot. Use a pot with drainage holes, feed it lightly during "
                 "spring and summer, and wipe dust off the leaves so they can breathe and catch light."},
    {"prompt": "What is inflation and why does it matter?",
     "response": "Inflation is the general rise in prices over time, which means each unit of money buys a little "
                 "less each year. Moderate, predictable inflation is considered normal, and central banks often aim "
                 "for about two percent a year. High inflation erodes savings and fixed incomes and makes planning "
                 "hard, while falling prices can lead people to delay spending, slowing the economy."},
    {"prompt": "Write a JavaScript function that reverses a string.",
     "response": "Split the string into characters, reverse the array and join it again:\n\n```javascript\n"
                 "function reverseString(text) {\n  return Array.from(text).reverse().join(\"\");\n}\n```\n\n"
                 "`Array.from` splits by code points, so characters such as emoji stay intact, which "
                 "`text.split(\"\")` would break apart. For example, `reverseString(\"hello\")` returns "
                 "`\"olleh\"`."},
)
