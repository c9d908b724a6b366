"""The general-knowledge questions of :mod:`kvos.builtin.knowledge`, each with a concise reference answer.

Written for kvos (original text): science, history, geography, cooking, programming concepts and everyday
things; each answer 2-5 sentences, about 50-120 tokens in a common BPE tokenizer. A session asks 12 of them
between the planted fact and its probe, so they must not depend on one another or on anything personal.
"""

from __future__ import annotations

QUESTIONS: tuple[tuple[str, str], ...] = (
    # ------------------------------------------------------------------------------------------- science
    (
        "Why is the sky blue?",
        "Sunlight holds every colour, and on its way through the air it bounces off nitrogen and oxygen "
        "molecules. Short wavelengths scatter much more strongly than long ones, an effect called Rayleigh "
        "scattering, so blue light is spread across the whole sky and reaches your eyes from every "
        "direction. At sunrise and sunset the light crosses far more air, most of the blue is scattered "
        "away, and the reds and oranges are what is left. The same effect makes distant mountains look "
        "bluish.",
    ),
    (
        "How do plants make their own food?",
        "Plants make sugar by photosynthesis. The chlorophyll in their leaves absorbs sunlight and uses its "
        "energy to join carbon dioxide from the air with water drawn up through the roots. The result is "
        "glucose, which the plant burns for energy or stores as starch, and oxygen, which it releases into "
        "the air as a by-product. It takes place mostly in tiny structures called chloroplasts, and it is "
        "the source of nearly all the oxygen animals breathe.",
    ),
    (
        "What causes the seasons on Earth?",
        "The seasons come from the tilt of Earth's axis, about 23.5 degrees, not from our distance to the "
        "Sun. For part of the year one hemisphere leans toward the Sun, so it gets longer days and more "
        "direct sunlight: that is its summer. Six months later it leans away, the light arrives at a low "
        "angle and the days are short, which gives winter. That is also why the seasons are reversed "
        "between the northern and southern hemispheres.",
    ),
    (
        "How does a vaccine protect you from a disease?",
        "A vaccine shows your immune system a harmless version or piece of a germ, such as a weakened virus "
        "or one of its proteins. Your body responds by making antibodies and memory cells that recognise "
        "it. If the real germ turns up later, those memory cells react within days instead of weeks, and "
        "they usually stop the infection before it makes you seriously ill. When enough people in a "
        "community are vaccinated, the germ also struggles to spread, which protects people who cannot be "
        "vaccinated.",
    ),
    (
        "What is the difference between weather and climate?",
        "Weather is what the atmosphere is doing at a given place and moment: rain this afternoon, a cold "
        "wind tomorrow. Climate is the pattern of that weather averaged over decades, such as how warm "
        "summers usually are or how much rain a region gets in a typical year. A single cold week says "
        "little about the climate, while a trend over thirty years says a lot. Forecasters predict the "
        "weather a few days ahead, while climate scientists study changes over many years.",
    ),
    (
        "Why does ice float on water?",
        "When water freezes, its molecules lock into a hexagonal crystal held together by hydrogen bonds, "
        "and that lattice leaves more empty space than liquid water does. Ice is therefore about nine "
        "percent less dense than the water around it, so it floats. This matters for life: lakes freeze "
        "from the top down, and the ice layer insulates the water below it. Most other substances are "
        "denser as solids than as liquids, so water is unusual in this respect.",
    ),
    (
        "How do magnets work?",
        "Every electron behaves like a tiny magnet because of a property called spin. In most materials "
        "these tiny magnets point in random directions and cancel out, but in iron, nickel and cobalt they "
        "can line up in large regions called domains. When most domains point the same way, the whole piece "
        "produces a magnetic field with a north and a south pole. Heating a magnet strongly or hitting it "
        "hard can scramble its domains again and weaken it.",
    ),
    (
        "What is DNA?",
        "DNA is the molecule that carries the genetic instructions of living things. It is a long double "
        "helix whose two strands are linked by pairs of four bases, written A, T, C and G. The order of "
        "those bases spells out genes, which cells read to build proteins, and the molecule is copied every "
        "time a cell divides. Almost every cell in your body holds a full copy of it, about two metres long "
        "if it were stretched out.",
    ),
    (
        "Why does the sea have tides?",
        "Tides are caused mainly by the Moon's gravity pulling on the oceans. The water on the side of "
        "Earth facing the Moon is pulled a little more than the planet itself, and the water on the far "
        "side a little less, so two bulges form. As Earth turns, most coasts pass through both bulges, "
        "which gives roughly two high tides and two low tides a day. The Sun adds its own smaller pull, so "
        "the highest tides come when the Sun and the Moon line up.",
    ),
    (
        "How does sound travel?",
        "Sound is a vibration passed from particle to particle through a material. A vibrating object "
        "pushes on the air next to it, creating regions of higher and lower pressure that spread outward as "
        "a wave. It travels at about 343 metres per second in air, faster in water and faster still in "
        "steel, and it cannot cross a vacuum at all. How high or low a sound seems depends on its "
        "frequency, the number of vibrations per second.",
    ),
    (
        "What is a black hole?",
        "A black hole is a region of space where matter is packed so densely that nothing, not even light, "
        "can escape its gravity. Many form when a very massive star runs out of fuel and its core "
        "collapses. The boundary beyond which escape is impossible is called the event horizon, and giant "
        "black holes sit at the centres of most galaxies. Astronomers cannot see black holes directly, but "
        "they detect them by their effect on nearby stars and gas.",
    ),
    (
        "How do bees make honey?",
        "Worker bees collect nectar from flowers and carry it back to the hive in a special stomach. There "
        "they pass it from bee to bee, adding enzymes that break its sugars down into simpler ones. The "
        "bees then store it in wax cells and fan it with their wings until most of the water evaporates, "
        "and finally they seal each cell with a wax cap. A single hive can produce many kilograms of honey "
        "in a good year, which feeds the colony through winter.",
    ),
    (
        "What causes earthquakes?",
        "Earth's outer shell is broken into tectonic plates that slowly move against each other. Along "
        "faults the rocks lock together while stress builds up for years or centuries. When the stress "
        "becomes greater than the friction holding them, the rocks slip suddenly and release energy as "
        "seismic waves, which we feel as shaking. Most earthquakes happen along the edges of plates, and "
        "scientists measure their strength on the moment magnitude scale.",
    ),
    (
        "How does the human heart pump blood?",
        "The heart is a muscle with four chambers: two atria on top and two ventricles below. The right "
        "side receives used blood from the body and sends it to the lungs to pick up oxygen, while the left "
        "side pumps that fresh blood out to the rest of the body. Valves between the chambers keep the "
        "blood flowing in one direction, and an electrical signal makes the heart beat in rhythm. At rest "
        "an adult heart beats about 60 to 100 times a minute.",
    ),
    # ------------------------------------------------------------------------------------------- history
    (
        "Why was the printing press so important?",
        "Before Johannes Gutenberg's press of around 1450, books in Europe were copied by hand and were "
        "rare and expensive. Movable metal type let printers produce many identical copies quickly and "
        "cheaply. Ideas could spread across a continent within years, which helped fuel the Reformation, "
        "the Scientific Revolution and the growth of literacy. Printed books also helped standardise "
        "spelling and languages.",
    ),
    (
        "What was the Silk Road?",
        "The Silk Road was a network of trade routes linking China with Central Asia, Persia, the Middle "
        "East and the Mediterranean for more than a thousand years. Merchants carried silk, spices, paper "
        "and horses along it, usually passing goods from one trader to the next rather than travelling the "
        "whole way. Religions, technologies and diseases travelled along the same routes. Its name was "
        "coined in the nineteenth century by a German geographer.",
    ),
    (
        "Who built the pyramids of Giza, and why?",
        "The pyramids of Giza were built about 4,500 years ago as tombs for the pharaohs Khufu, Khafre and "
        "Menkaure. They were not built by slaves, as is often said, but by organised crews of paid workers "
        "who lived in a town nearby. The pyramids were meant to protect the king's body and help his spirit "
        "on its journey into the afterlife. The largest, the Great Pyramid, was the tallest human-made "
        "structure in the world for almost 4,000 years.",
    ),
    (
        "What was the Industrial Revolution?",
        "The Industrial Revolution was the shift from hand production to machines, starting in Britain in "
        "the late 1700s. Steam engines, mechanised textile mills and new ways of making iron transformed "
        "how goods were made. Millions of people moved from farms to growing cities to work in factories, "
        "which raised output enormously but also brought crowded housing and hard working conditions. It "
        "later spread to the rest of Europe, North America and beyond.",
    ),
    (
        "Why did the Romans build so many roads?",
        "Roman roads let armies march quickly to any corner of the empire, which helped Rome hold on to "
        "vast territories. They also carried traders, tax collectors and official messengers. The roads "
        "were built in layers of stone and gravel with a curved surface that shed water, and some of them "
        "are still in use today. At its height the network stretched for tens of thousands of kilometres, "
        "giving rise to the saying that all roads lead to Rome.",
    ),
    (
        "What was the Renaissance?",
        "The Renaissance was a period of cultural revival in Europe, roughly from the fourteenth to the "
        "seventeenth century, that began in Italian cities such as Florence. Scholars rediscovered ancient "
        "Greek and Roman texts, and artists like Leonardo da Vinci and Michelangelo studied anatomy and "
        "perspective. It shifted attention toward human experience, observation and learning. The invention "
        "of the printing press helped its ideas spread across Europe.",
    ),
    (
        "How did the Apollo 11 mission reach the Moon?",
        "In July 1969 a Saturn V rocket launched three astronauts toward the Moon. After three days in "
        "space, Neil Armstrong and Buzz Aldrin descended in the lunar module Eagle while Michael Collins "
        "stayed in orbit in the command module. The two walked on the surface for about two and a half "
        "hours, then rejoined Collins and the crew returned safely to Earth. Armstrong's first step was "
        "watched live on television by hundreds of millions of people.",
    ),
    (
        "What was the Magna Carta?",
        "The Magna Carta was a charter that rebellious English barons forced King John to accept in 1215. "
        "It said that the king, too, was bound by the law, and it protected certain rights such as freedom "
        "from unlawful imprisonment. Many of its clauses were soon dropped, but it became a lasting symbol "
        "of limits on royal power. A few of its principles later influenced documents such as the United "
        "States Constitution.",
    ),
    (
        "Why was the Berlin Wall built, and when did it fall?",
        "East Germany built the Berlin Wall in 1961 to stop its citizens from escaping to West Berlin, "
        "through which millions had already left. For 28 years it split the city in two and became a symbol "
        "of the Cold War. It fell on 9 November 1989, when the border was opened amid mass protests, and "
        "Germany was reunified the following year. Many people tried to cross it over the years, and more "
        "than a hundred died in the attempt.",
    ),
    (
        "What was the purpose of the Great Wall of China?",
        "The Great Wall was built and rebuilt over many centuries to protect Chinese states from raids by "
        "nomadic peoples from the north. Besides being a barrier, it worked as a system of watchtowers that "
        "could send warning signals with smoke or fire. Most of what visitors see today dates from the Ming "
        "dynasty. Counting all its sections and branches, it runs for thousands of kilometres across "
        "northern China, over mountains and deserts.",
    ),
    # ----------------------------------------------------------------------------------------- geography
    (
        "Why is the Dead Sea so salty?",
        "The Dead Sea lies in a deep basin with no outlet: the Jordan River flows in, but water only leaves "
        "by evaporation. The hot, dry climate evaporates a great deal of water and leaves the dissolved "
        "minerals behind. Over thousands of years the salt has built up to about ten times the "
        "concentration of the ocean, which is why people float so easily in it. Its shore is also the "
        "lowest point on land, more than 400 metres below sea level.",
    ),
    (
        "What is the longest river in the world?",
        "The Nile is usually named the longest river, at about 6,650 kilometres, flowing north through "
        "eastern Africa into the Mediterranean. Some researchers argue the Amazon is slightly longer, "
        "depending on where its source is placed. The Amazon is certainly the largest by volume, carrying "
        "more water than the next several rivers combined. Both rivers support millions of people and a "
        "huge variety of wildlife along their banks.",
    ),
    (
        "How are mountains formed?",
        "Most great mountain ranges form where tectonic plates collide. The crust crumples and is pushed "
        "upward over millions of years, which is how the Himalayas rose when India pushed into Asia. Other "
        "mountains are volcanoes built up from erupted lava and ash, and some are blocks of crust lifted "
        "along faults. At the same time, wind, water and ice slowly wear mountains down, so old ranges tend "
        "to be lower and rounder.",
    ),
    (
        "What is a fjord?",
        "A fjord is a long, narrow and deep inlet of the sea between steep cliffs. Fjords were carved by "
        "glaciers during ice ages, which cut valleys far below sea level; when the ice melted, the sea "
        "flooded in. Norway, New Zealand, Chile and Greenland are famous for them. Some fjords are more "
        "than a kilometre deep, much deeper than the sea just outside them.",
    ),
    (
        "Why are deserts so dry?",
        "Many deserts lie near 30 degrees north or south of the equator, where air that has risen and lost "
        "its moisture in the tropics sinks again and warms, which prevents clouds from forming. Others sit "
        "in the rain shadow of mountains, which force incoming air to drop its rain on the other side. "
        "Deserts are defined by low rainfall, not heat, so Antarctica counts as one too. Cold ocean "
        "currents along some coasts also keep rain away, as in the Atacama Desert of Chile.",
    ),
    (
        "What is the Ring of Fire?",
        "The Ring of Fire is a horseshoe-shaped belt around the edges of the Pacific Ocean where many "
        "tectonic plates meet. It holds about three quarters of the world's active volcanoes, and most "
        "large earthquakes happen there. Japan, Indonesia, Chile and the west coast of North America all "
        "lie along it. Most of its volcanoes form where one plate sinks beneath another, a process called "
        "subduction.",
    ),
    (
        "Why does Iceland have so many hot springs?",
        "Iceland sits on the Mid-Atlantic Ridge, where the North American and Eurasian plates pull apart, "
        "and above a hotspot of rising hot rock. Magma lies close to the surface there and heats "
        "groundwater, which rises as hot springs and geysers. Icelanders use that heat to warm most of "
        "their homes and to generate electricity. The word geyser itself comes from Geysir, a famous hot "
        "spring in Iceland.",
    ),
    (
        "What is a monsoon?",
        "A monsoon is a seasonal reversal of the prevailing winds that brings a long rainy season. In South "
        "Asia, land heats up faster than the ocean in summer, so moist air is drawn in from the Indian "
        "Ocean and falls as heavy rain from about June to September. Farmers depend on it, but a weak "
        "monsoon can cause drought and a strong one floods. Monsoons also occur in West Africa, northern "
        "Australia and parts of the Americas.",
    ),
    (
        "Why is the Amazon rainforest important?",
        "The Amazon is the largest tropical rainforest on Earth and is home to an enormous share of the "
        "world's plant and animal species. Its trees store huge amounts of carbon, which helps slow climate "
        "change. The forest also recycles moisture into the air, creating rainfall that reaches far beyond "
        "the forest itself. It spreads across nine countries, with the largest part in Brazil, and "
        "deforestation threatens it.",
    ),
    (
        "How do rivers form deltas?",
        "A river carries sand, silt and clay as it flows. When it reaches the sea or a lake, it slows down "
        "and can no longer carry that load, so the sediment settles near the mouth. Over time it builds up "
        "new land that the river splits into many channels, often in a fan shape like the Greek letter "
        "delta. Delta soils are very fertile, so deltas such as those of the Nile and the Ganges have long "
        "been farmed.",
    ),
    # ------------------------------------------------------------------------------------------- cooking
    (
        "Why should you let meat rest after cooking it?",
        "While meat cooks, the muscle fibres tighten and push juices toward the centre. Resting it for a "
        "few minutes lets the temperature even out and the fibres relax, so the juices spread back through "
        "the meat. If you cut it straight away, more of those juices end up on the board instead of in each "
        "bite. As a rough guide, rest a steak for about five minutes and a large roast for fifteen to "
        "twenty.",
    ),
    (
        "How does bread dough rise?",
        "Yeast in the dough feeds on sugars from the flour and gives off carbon dioxide gas. Kneading "
        "develops gluten, a stretchy network of proteins that traps the gas in small bubbles, so the dough "
        "swells. In the oven the bubbles expand further, and then the heat sets the structure into a soft, "
        "airy crumb. Warmth speeds up the yeast, which is why recipes often ask you to leave the dough "
        "somewhere warm.",
    ),
    (
        "What is the difference between baking soda and baking powder?",
        "Baking soda is pure sodium bicarbonate, which needs an acid in the recipe, such as buttermilk, "
        "yogurt or lemon juice, to release carbon dioxide. Baking powder already contains both the soda and "
        "a dry acid, so it only needs moisture and heat to work. That is why recipes without acidic "
        "ingredients usually call for baking powder. Baking soda is also about three times stronger, so you "
        "need less of it.",
    ),
    (
        "How do I cook rice on the stove?",
        "Rinse the rice until the water runs clear, then put it in a pot with about one and a half times "
        "its volume of water and a pinch of salt. Bring it to a boil, cover it, and turn the heat to low "
        "for about 15 minutes. Take it off the heat and let it sit, still covered, for 10 minutes before "
        "fluffing it with a fork. Avoid lifting the lid while it cooks, because the steam does much of the "
        "work.",
    ),
    (
        "Why do onions make you cry?",
        "Cutting an onion breaks its cells and releases enzymes that turn sulphur compounds into a volatile "
        "gas. When that gas reaches your eyes, it reacts with the moisture there and irritates them, so "
        "they produce tears to wash it away. A sharp knife and a chilled onion release less of it. Some "
        "cooks also cut the root end last, since it holds the most of these compounds.",
    ),
    (
        "What does it mean to caramelise onions?",
        "Caramelising onions means cooking sliced onions slowly over low heat in a little fat until their "
        "natural sugars brown. It usually takes 30 to 45 minutes of occasional stirring. The onions turn "
        "soft, deep golden brown and sweet, which makes them good for soups, sandwiches and tarts. Adding a "
        "pinch of salt at the start draws out moisture, and a splash of water helps if they begin to stick.",
    ),
    (
        "How do I make a basic vinaigrette?",
        "A classic vinaigrette is about three parts oil to one part vinegar or lemon juice. Whisk the "
        "vinegar with a pinch of salt and a spoon of mustard, which helps the mixture stay blended, then "
        "slowly whisk in the oil. Season it with pepper, and add herbs, garlic or a little honey if you "
        "like. It keeps for about a week in the fridge; just shake it again before using it.",
    ),
    (
        "Why do people salt the water for pasta?",
        "Pasta absorbs water as it cooks, so salting the water is the only chance to season the pasta "
        "itself. A common guide is about ten grams of salt per litre of water. The salt has little effect "
        "on the boiling point, and it does not stop the pasta from sticking; stirring does that. Add the "
        "salt once the water is boiling, and taste the pasta before draining it.",
    ),
    (
        "What is the Maillard reaction?",
        "The Maillard reaction is a chemical reaction between amino acids and sugars that happens when food "
        "is heated, usually above about 140 degrees Celsius. It creates the brown colour and rich, savoury "
        "flavours of seared steak, toasted bread and roasted coffee. It needs fairly dry surfaces, which is "
        "why patting meat dry helps it brown. It is different from caramelisation, which involves sugars "
        "alone.",
    ),
    (
        "How can I tell whether an egg is fresh?",
        "Place the egg in a bowl of cold water. A fresh egg sinks and lies flat on its side, while an older "
        "egg tilts or stands upright because its air cell has grown larger. An egg that floats is best "
        "thrown away. A fresh egg also has a firm, rounded yolk and a thick white when cracked.",
    ),
    # --------------------------------------------------------------------------------------- programming
    (
        "What is a variable in programming?",
        "A variable is a name that refers to a value stored in a program's memory. You can set it, read it "
        "and change it while the program runs, for example keeping a running total in a variable called "
        "total. Good variable names make code much easier to read and understand. In some languages a "
        "variable has a fixed type, such as an integer or a string, while in others it can hold any kind of "
        "value.",
    ),
    (
        "What is recursion?",
        "Recursion is when a function solves a problem by calling itself on a smaller version of the same "
        "problem. Every recursive function needs a base case, a simple input it answers directly, or it "
        "would call itself forever. Computing a factorial or walking through a tree of folders are classic "
        "examples. Any recursive solution can also be written with a loop, though sometimes less clearly.",
    ),
    (
        "What is the difference between a list and a tuple in Python?",
        "Both hold ordered sequences of items, but a list is mutable and a tuple is immutable. You can "
        "append to, remove from and change the items of a list after creating it, while a tuple stays "
        "fixed. Because they cannot change, tuples can be used as dictionary keys, and they signal that the "
        "data is not meant to be modified. Lists are written with square brackets and tuples with "
        "parentheses.",
    ),
    (
        "What does a compiler do?",
        "A compiler translates source code written in a programming language into a lower-level form that a "
        "machine can run, such as machine code or bytecode. Along the way it checks the program for errors "
        "like wrong types or misspelled names. Many compilers also optimise the code so that it runs faster "
        "or uses less memory. Languages like C and Rust are usually compiled, while others such as Python "
        "are often run by an interpreter.",
    ),
    (
        "What is version control?",
        "Version control is a system that records changes to files over time, so you can see who changed "
        "what, and return to any earlier version. Tools like Git let several people work on the same "
        "project at once in separate branches and then merge their work. It also acts as a safety net when "
        "an experiment goes wrong. Each saved set of changes, called a commit, comes with a message that "
        "explains why it was made.",
    ),
    (
        "What is a hash table?",
        "A hash table is a data structure that stores key-value pairs. It runs each key through a hash "
        "function that turns it into an index in an array, so a value can be found in roughly constant "
        "time, without searching through everything. When two keys land on the same slot, called a "
        "collision, the table handles it by chaining or probing. Python's dictionaries and Java's HashMap "
        "are hash tables.",
    ),
    (
        "What is an API?",
        "An API, or application programming interface, is a defined way for one piece of software to talk "
        "to another. It lists the requests you can make, the data they take and what they return, while "
        "hiding how the work is done inside. A weather app, for example, might call a web API to fetch the "
        "forecast for a city. Good APIs are stable, so programs built on them keep working when the "
        "internals change.",
    ),
    (
        "What is the difference between a process and a thread?",
        "A process is a running program with its own separate memory space. A thread is a path of execution "
        "inside a process, and all the threads of one process share the same memory. Threads are cheaper to "
        "create and can exchange data easily, but that sharing means they need care, such as locks, to "
        "avoid corrupting data. If one process crashes, the others usually keep running, because their "
        "memory is kept apart.",
    ),
    (
        "What is Big O notation?",
        "Big O notation describes how the running time or memory of an algorithm grows as its input gets "
        "larger. For example, O(n) means the work grows in proportion to the input, while O(n squared) "
        "means doubling the input roughly quadruples the work. It ignores constant factors and focuses on "
        "behaviour at large sizes. Binary search, for instance, runs in O(log n) time, which is much faster "
        "than checking every item.",
    ),
    (
        "Why do programmers write unit tests?",
        "Unit tests check that small pieces of code, such as single functions, behave as intended. They "
        "catch mistakes early, and when someone changes the code later, running the tests shows at once "
        "whether something broke. Tests also document how the code is supposed to be used. They usually run "
        "automatically on every change, so problems are found before the code reaches users. Good tests are "
        "fast, independent of each other and easy to read.",
    ),
    (
        "What is a database index?",
        "A database index is an extra data structure, often a B-tree, that lets the database find rows "
        "quickly without scanning the whole table, much like the index at the back of a book. It speeds up "
        "searches and sorting on the indexed columns. The cost is extra storage and slightly slower writes, "
        "because the index must be updated too. Database designers therefore add indexes to the columns "
        "that queries filter or join on most often.",
    ),
    (
        "What does garbage collection mean in programming?",
        "Garbage collection is automatic memory management. The language runtime keeps track of which "
        "objects a program can still reach and frees the memory of those it can no longer use. This saves "
        "programmers from freeing memory by hand and prevents many bugs, at the cost of some extra work and "
        "occasional pauses. Java, Python, Go and JavaScript all use garbage collection, while languages "
        "such as C leave memory to the programmer.",
    ),
    (
        "What is object-oriented programming?",
        "Object-oriented programming organises code around objects, which bundle data together with the "
        "functions that act on it. Objects are created from classes, which work like blueprints. Ideas such "
        "as encapsulation, inheritance and polymorphism help structure large programs and reuse code. A "
        "class called Car, for example, might hold a colour and a speed, with methods to accelerate and "
        "brake. Java, C++ and Python all support this style.",
    ),
    # ---------------------------------------------------------------------------------------- everyday
    (
        "How does a rainbow form?",
        "A rainbow appears when sunlight shines into raindrops while the Sun is behind you. Each drop bends "
        "the light as it enters, reflects it off the back of the drop and bends it again on the way out. "
        "Because each colour bends by a slightly different amount, the white light spreads into a band from "
        "red on the outside to violet on the inside. Sometimes a fainter second rainbow appears above the "
        "first, with its colours in the reverse order.",
    ),
    (
        "Why do cats purr?",
        "Cats purr by rapidly twitching the muscles of their voice box as they breathe in and out. They "
        "often purr when they are content, but also when they are stressed, hurt or giving birth, so it "
        "seems to work as a way to calm themselves. Some research suggests the low vibration may even help "
        "heal bones and tissue. Kittens can purr when they are only a few days old, and mother cats purr to "
        "guide them.",
    ),
    (
        "How much water should a person drink each day?",
        "There is no single rule, because needs depend on body size, activity and climate. A common "
        "guideline is around two to three litres of fluid a day for adults, and part of that comes from "
        "food. Drinking when you are thirsty and having pale yellow urine are good signs that you are "
        "getting enough. You need more in hot weather, during exercise or when you are ill.",
    ),
    (
        "Why do leaves change colour in autumn?",
        "Leaves are green because of chlorophyll, which trees keep making all summer. As days shorten and "
        "temperatures drop, trees stop producing it, and the green fades. Yellow and orange pigments that "
        "were there all along become visible, and some trees also make red pigments from sugars trapped in "
        "the leaf. Sunny days and cool nights tend to give the brightest colours.",
    ),
    (
        "How does a bicycle stay upright?",
        "A moving bicycle stays upright mainly because the rider keeps steering it under its own centre of "
        "mass. When the bike starts to lean, the front wheel turns into the lean, which brings the wheels "
        "back under the rider. The shape of the fork helps the wheel steer itself, which is why a bike is "
        "much easier to balance when it is moving. Spinning wheels act a little like gyroscopes, but their "
        "effect is smaller than most people think.",
    ),
    (
        "What is inflation in economics?",
        "Inflation is the general rise in prices over time, which means each unit of money buys less than "
        "it used to. It can happen when demand grows faster than the supply of goods, or when costs such as "
        "energy go up. Central banks usually try to keep it low and stable, often around two percent a "
        "year. When inflation is too high, savings lose value quickly; when prices fall instead, it is "
        "called deflation.",
    ),
    (
        "How does a refrigerator keep food cold?",
        "A refrigerator moves heat from inside to outside using a circulating refrigerant. The refrigerant "
        "evaporates in coils inside the fridge, absorbing heat from the food, and a compressor then "
        "squeezes the vapour, making it hot. In the coils at the back it releases that heat into the room "
        "and condenses, and the cycle starts again. A thermostat switches the compressor on and off to hold "
        "the temperature near about four degrees Celsius.",
    ),
    (
        "Why is sleep important?",
        "During sleep the body repairs tissues and the brain sorts and stores memories from the day. Sleep "
        "also helps regulate mood, appetite and the immune system. Most adults need about seven to nine "
        "hours a night, and lasting sleep loss raises the risk of accidents and many health problems. "
        "Keeping a regular schedule and avoiding screens before bed can help you sleep better. Caffeine "
        "late in the day also makes it harder to fall asleep.",
    ),
    (
        "What is the greenhouse effect?",
        "The greenhouse effect is the warming of Earth's surface by gases in the atmosphere that trap heat. "
        "Sunlight warms the ground, which gives off infrared radiation, and gases such as carbon dioxide, "
        "methane and water vapour absorb part of it and send it back down. Without it the planet would be "
        "far too cold for us, but adding more of these gases makes it warmer. Burning fossil fuels has "
        "raised the amount of carbon dioxide in the air by about half since the industrial era began.",
    ),
    (
        "How do airplanes stay in the air?",
        "An airplane's wings are shaped and tilted so that air flowing over them is pushed downward. By "
        "pushing air down, the wing gets an equal push up, called lift, and the pressure above the wing is "
        "lower than below it. The engines provide thrust to keep the plane moving fast enough for the lift "
        "to balance its weight. Flaps on the wings change their shape during take-off and landing to "
        "produce more lift at low speed.",
    ),
    (
        "What is a haiku?",
        "A haiku is a short form of poetry that comes from Japan. In English it is usually written as three "
        "lines of five, seven and five syllables. Traditional haiku capture a single moment in nature and "
        "often include a word that hints at the season. Matsuo Basho, a poet of the seventeenth century, is "
        "the most famous master of the form. Many poets today write haiku in English and other languages as "
        "well.",
    ),
    (
        "Why do we get hiccups?",
        "A hiccup is a sudden, involuntary contraction of the diaphragm, the muscle below the lungs. Right "
        "after it starts, the vocal cords snap shut, which makes the typical hic sound. Eating too fast, "
        "fizzy drinks or excitement can trigger them, and they usually stop on their own within a few "
        "minutes. Holding your breath or sipping cold water may help, though none of the home remedies "
        "works every time.",
    ),
    (
        "How do solar panels make electricity?",
        "Solar panels are made of cells, usually of silicon, that are treated to have an electric field "
        "inside them. When sunlight strikes a cell, it knocks electrons loose, and the field pushes them in "
        "one direction, creating a current. An inverter then turns that direct current into the alternating "
        "current used in homes. A typical panel turns around a fifth of the sunlight that falls on it into "
        "electricity, and panels keep working for decades.",
    ),
)
