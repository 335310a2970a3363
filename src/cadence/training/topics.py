"""Topic and persona lists for the templated prompt sources (``cadence.training.sources``).

Knows: hand-written lists of concepts, comparisons, events, works, personas and record
fields, written for this repository. Does not know: templates' wording (in ``sources``),
tokenizers, models, any benchmark's questions (none were copied here).

Every list is plain data; ``sources`` combines them with its templates under a seed.
"""

from __future__ import annotations

# ---------------------------------------------------------------- translation

# target languages of English -> X requests (the first ones repeat: they are asked for more often)
LANGUAGES = ["French", "Spanish", "German", "Italian", "Portuguese", "Chinese", "Japanese", "Dutch", "Russian",
             "Korean", "Polish", "Turkish", "Swedish", "Arabic", "Hindi", "Greek", "French", "Spanish", "German",
             "Chinese"]

# short everyday sentences for English -> X requests, beside the ones taken from ShareGPT replies
EVERYDAY = [
    "The meeting has been moved to Thursday afternoon.",
    "Please leave your shoes at the door.", "We ran out of milk, so I went to the corner shop.",
    "My sister is studying marine biology at the university.", "The bus was late again this morning.",
    "I have never seen so many stars in the sky.", "Do you know a good place to eat around here?",
    "The children are playing football in the park.",
    "The library closes early on Sundays.", "Our flight was delayed by three hours because of fog.",
    "Could you speak a little more slowly, please?", "The soup needs a little more salt.",
    "I am looking for a birthday present for my father.", "It has been raining all week.",
    "The new bridge will open to traffic next spring.", "She plays the violin in a small orchestra.",
    "We should water the plants before we leave.", "How much does a ticket to the city centre cost?",
    "The museum has a large collection of old maps.", "I would like to open a bank account.",
    "They painted the kitchen a bright yellow.", "The doctor said I should rest for a few days.",
    "My phone battery is almost empty.", "The train to the airport leaves every twenty minutes.",
    "Thank you for helping me carry the boxes.", "The cake is in the oven and will be ready soon.",
    "Please send me the documents by Friday.", "The river froze over during the cold winter.",
    "Where can I buy a map of the old town?",
    "I usually drink tea in the morning and coffee after lunch.", "This street is very quiet at night.",
    "He has lived in the same village all his life.", "We are planning a trip to the mountains in July.",
    "The shop around the corner sells fresh bread every morning.", "Can I pay by card?",
    "The teacher asked the students to read the first chapter.", "Our neighbours have a very friendly dog.",
    "I lost my keys somewhere between the office and home.", "The hotel room has a view of the harbour.",
    "Turn left at the traffic lights and go straight on.", "The garden is full of tulips in April.",
    "She finished the marathon in just under four hours.", "The price of vegetables has gone up.",
    "Let's meet in front of the cinema at seven.", "I need to renew my passport before the trip.",
    "The film was much better than the book.",
]

# ---------------------------------------------------------------- STEM

STEM_CONCEPTS = [
    # physics
    "Newton's second law", "conservation of momentum", "kinetic and potential energy", "friction", "torque",
    "centripetal force", "simple harmonic motion", "the Doppler effect", "refraction of light",
    "total internal reflection", "electric current and voltage", "Ohm's law", "electromagnetic induction",
    "the photoelectric effect", "wave-particle duality", "the uncertainty principle", "entropy",
    "the laws of thermodynamics", "heat conduction, convection and radiation", "buoyancy",
    "special relativity's time dilation", "nuclear fission", "nuclear fusion in stars", "radioactive half-life",
    "superconductivity", "semiconductors", "lasers", "black holes", "gravitational waves", "dark matter",
    "the expansion of the universe", "pressure in fluids", "Bernoulli's principle", "sound waves",
    # chemistry
    "chemical equilibrium", "acids and bases", "the pH scale", "oxidation and reduction", "covalent and ionic bonds",
    "electronegativity", "the periodic table's trends", "catalysts", "reaction rates", "isotopes",
    "polymers", "hydrogen bonding", "the ideal gas law", "enthalpy", "electrolysis", "organic functional groups",
    "chirality in molecules", "buffer solutions", "solubility", "combustion",
    # biology and medicine
    "photosynthesis", "cellular respiration", "DNA replication", "transcription and translation of genes",
    "natural selection", "genetic drift", "mitosis and meiosis", "the immune response", "vaccines",
    "antibiotic resistance", "enzymes", "the nervous system", "hormones", "the circulatory system",
    "ecosystems and food webs", "the nitrogen cycle", "CRISPR gene editing", "stem cells", "viruses",
    "the microbiome", "homeostasis", "protein folding", "symbiosis", "the carbon cycle",
    "blood pressure", "insulin and blood sugar", "sleep and the brain", "how muscles contract",
    # earth and space
    "plate tectonics", "the water cycle", "the greenhouse effect", "ocean currents", "earthquakes",
    "volcanoes", "the seasons", "the phases of the Moon", "tides", "the formation of the Solar System",
    "weather fronts", "the ozone layer", "erosion", "the rock cycle", "exoplanet detection",
    # mathematics
    "prime numbers", "the Pythagorean theorem", "derivatives", "integrals", "limits", "probability",
    "conditional probability", "Bayes' theorem", "the normal distribution", "standard deviation",
    "linear regression", "matrices", "eigenvalues and eigenvectors", "complex numbers", "logarithms",
    "exponential growth", "mathematical induction", "proof by contradiction", "graph theory", "sets and functions",
    "the Fibonacci sequence", "modular arithmetic", "vectors", "differential equations", "the law of large numbers",
    # computing and engineering
    "binary numbers", "algorithms and their complexity", "Big-O notation", "recursion", "sorting algorithms",
    "hash tables", "public-key cryptography", "how the internet routes packets", "operating systems",
    "compilers", "databases and indexes", "machine learning", "neural networks", "gradient descent",
    "overfitting", "computer memory and caches", "parallel computing", "version control",
    "how a transistor works", "electric motors", "bridges and load distribution", "solar panels",
    "batteries", "how a refrigerator works", "GPS positioning", "error-correcting codes",
]

STEM_PAIRS = [
    ("mass", "weight"), ("speed", "velocity"), ("heat", "temperature"), ("AC", "DC current"),
    ("nuclear fission", "nuclear fusion"), ("an element", "a compound"), ("a mixture", "a solution"),
    ("endothermic", "exothermic reactions"), ("mitosis", "meiosis"), ("DNA", "RNA"),
    ("innate", "adaptive immunity"),
    ("a meteor", "a meteorite"), ("a comet", "an asteroid"), ("permutations", "combinations"),
    ("mean", "median"), ("correlation", "causation"), ("a derivative", "an integral"),
    ("RAM", "storage"), ("a compiler", "an interpreter"), ("TCP", "UDP"), ("a process", "a thread"),
    ("supervised", "unsupervised learning"), ("a stack", "a queue"), ("arrays", "linked lists"),
    ("potential", "kinetic energy"), ("series", "parallel circuits"), ("conductors", "insulators"),
    ("prokaryotic", "eukaryotic cells"), ("arteries", "veins"), ("igneous", "sedimentary rocks"),
    ("a planet", "a dwarf planet"), ("rational", "irrational numbers"), ("precision", "accuracy"),
]

STEM_PROBLEMS = [
    # (template, {name: (low, high)}) -- numbers drawn per item; the backbone works the answer out
    ("A car speeds up steadily from rest to {v} m/s in {t} seconds. What is its acceleration, and how far does "
     "it travel in that time?", {"v": (10, 40), "t": (4, 15)}),
    ("A ball is dropped from a height of {h} metres. Ignoring air resistance, how long does it take to reach "
     "the ground, and how fast is it moving when it lands?", {"h": (5, 80)}),
    ("A {r} ohm resistor is connected to a {u} volt battery. What current flows, and how much power does the "
     "resistor dissipate?", {"r": (2, 50), "u": (3, 24)}),
    ("How much energy is needed to heat {m} kg of water from {a} degrees Celsius to {b} degrees Celsius? "
     "Explain each step.", {"m": (1, 10), "a": (5, 25), "b": (40, 95)}),
    ("A radioactive sample has a half-life of {t} years. What fraction of it remains after {n} years?",
     {"t": (2, 30), "n": (10, 120)}),
    ("A gas occupies {v} litres at {p} kPa. If the pressure rises to {q} kPa at constant temperature, what is "
     "the new volume?", {"v": (2, 40), "p": (90, 150), "q": (160, 400)}),
    ("How many moles are in {g} grams of water? Show the calculation.", {"g": (9, 360)}),
    ("A rectangle has a perimeter of {p} cm and one side of {a} cm. What is its area?", {"p": (30, 120), "a": (3, 14)}),
    ("Find the derivative of f(x) = {a}x^3 - {b}x^2 + {c}x - 7 and the points where it equals zero.",
     {"a": (1, 6), "b": (2, 12), "c": (1, 9)}),
    ("Solve the system of equations {a}x + {b}y = {c} and x - y = {d}.", {"a": (2, 7), "b": (1, 6), "c": (10, 60),
                                                                          "d": (1, 9)}),
    ("What is the probability of getting exactly {k} heads in {n} tosses of a fair coin?", {"k": (1, 5), "n": (6, 10)}),
    ("A population of bacteria doubles every {t} minutes. Starting from {n} cells, how many are there after "
     "{h} hours?", {"t": (15, 60), "n": (10, 500), "h": (2, 6)}),
    ("A satellite circles the Earth at an altitude of {h} km. Roughly how long does one orbit take? Explain "
     "the physics you use.", {"h": (300, 2000)}),
    ("A lens has a focal length of {f} cm and an object stands {d} cm in front of it. Where does the image "
     "form, and is it real or virtual?", {"f": (5, 30), "d": (35, 120)}),
    ("An investment grows at {r}% per year, compounded yearly. How many years does it take to double? Compare "
     "with the rule of 72.", {"r": (2, 12)}),
    ("A sorting algorithm takes {s} seconds for {n} thousand items and runs in O(n log n) time. Estimate its "
     "time for {m} thousand items.", {"s": (1, 9), "n": (10, 100), "m": (200, 900)}),
]

# ---------------------------------------------------------------- humanities

HISTORY_EVENTS = [
    "the fall of the Western Roman Empire", "the signing of Magna Carta", "the Black Death in Europe",
    "the invention of the printing press", "the Protestant Reformation", "the voyages of Zheng He",
    "the Columbian Exchange", "the Thirty Years' War", "the Glorious Revolution", "the American Revolution",
    "the French Revolution", "the Haitian Revolution", "the Napoleonic Wars", "the Industrial Revolution",
    "the abolition of the transatlantic slave trade", "the Meiji Restoration", "the unification of Germany",
    "the unification of Italy", "the Scramble for Africa", "the First World War", "the Russian Revolution",
    "the Great Depression", "the rise of fascism in the 1930s", "the Second World War", "the Holocaust",
    "the founding of the United Nations", "the partition of India", "the Chinese Revolution of 1949",
    "the Cold War", "decolonisation in Africa", "the civil rights movement in the United States",
    "the space race", "the fall of the Berlin Wall", "the end of apartheid in South Africa",
    "the dissolution of the Soviet Union", "the rise of the Mongol Empire", "the Silk Road trade",
    "the Ottoman conquest of Constantinople", "the Renaissance in Florence", "the Age of Enlightenment",
    "the Crusades", "the Aztec Empire", "the Inca road system", "ancient Athenian democracy",
    "the reign of Ashoka", "the Tang dynasty", "the Edo period in Japan", "the Mughal Empire",
    "the Irish Famine", "the women's suffrage movement", "the Marshall Plan", "the Cuban Missile Crisis",
]

THINKERS = [
    "Socrates", "Plato", "Aristotle", "Confucius", "Laozi", "the Buddha", "Epicurus", "the Stoics",
    "Augustine", "Thomas Aquinas", "Ibn Sina", "Ibn Rushd", "Machiavelli", "Descartes", "Spinoza", "Hobbes",
    "Locke", "Hume", "Rousseau", "Kant", "Hegel", "Mary Wollstonecraft", "John Stuart Mill", "Marx",
    "Kierkegaard", "Nietzsche", "William James", "Wittgenstein", "Simone de Beauvoir", "Sartre", "Hannah Arendt",
    "John Rawls", "Adam Smith", "Keynes", "Hayek", "Montesquieu", "Zhuangzi", "Mencius", "Hypatia",
]

IDEAS = [
    "utilitarianism", "virtue ethics", "the social contract", "free will and determinism", "existentialism",
    "empiricism versus rationalism", "the mind-body problem", "moral relativism", "the categorical imperative",
    "the problem of evil", "stoicism", "nihilism", "pragmatism", "the separation of powers", "natural rights",
    "the tragedy of the commons", "the veil of ignorance", "Plato's allegory of the cave", "the ship of Theseus",
    "Occam's razor", "the scientific method as a philosophical idea", "aesthetic beauty", "justice as fairness",
    "civil disobedience", "cultural relativism", "the trolley problem", "personal identity over time",
]

WORKS = [
    ("Homer", "the Odyssey"), ("Sophocles", "Antigone"), ("Virgil", "the Aeneid"), ("Dante", "the Divine Comedy"),
    ("Chaucer", "The Canterbury Tales"), ("Cervantes", "Don Quixote"), ("Shakespeare", "Hamlet"),
    ("Shakespeare", "Macbeth"), ("Shakespeare", "King Lear"), ("Milton", "Paradise Lost"),
    ("Jonathan Swift", "Gulliver's Travels"), ("Jane Austen", "Pride and Prejudice"), ("Mary Shelley", "Frankenstein"),
    ("Charlotte Bronte", "Jane Eyre"), ("Emily Bronte", "Wuthering Heights"), ("Charles Dickens", "Great Expectations"),
    ("Herman Melville", "Moby-Dick"), ("Leo Tolstoy", "War and Peace"), ("Fyodor Dostoevsky", "Crime and Punishment"),
    ("George Eliot", "Middlemarch"), ("Gustave Flaubert", "Madame Bovary"), ("Victor Hugo", "Les Miserables"),
    ("Mark Twain", "Adventures of Huckleberry Finn"), ("Murasaki Shikibu", "The Tale of Genji"),
    ("Cao Xueqin", "Dream of the Red Chamber"), ("Franz Kafka", "The Metamorphosis"), ("James Joyce", "Ulysses"),
    ("Virginia Woolf", "Mrs Dalloway"), ("F. Scott Fitzgerald", "The Great Gatsby"), ("Chinua Achebe", "Things Fall Apart"),
    ("Gabriel Garcia Marquez", "One Hundred Years of Solitude"), ("George Orwell", "Nineteen Eighty-Four"),
    ("Toni Morrison", "Beloved"), ("Goethe", "Faust"), ("Henrik Ibsen", "A Doll's House"), ("Anton Chekhov", "The Cherry Orchard"),
    ("Emily Dickinson", "her poetry"), ("Walt Whitman", "Leaves of Grass"), ("Rumi", "the Masnavi"),
    ("Ovid", "the Metamorphoses"),
]

ARTS = [
    "Impressionism", "Cubism", "Surrealism", "the Baroque style", "Romanticism in painting", "Gothic architecture",
    "Renaissance perspective", "Byzantine mosaics", "Japanese woodblock prints", "Art Nouveau", "the Bauhaus",
    "Abstract Expressionism", "Pop Art", "Dutch Golden Age painting", "Islamic geometric art",
    "classical Greek sculpture", "the sonata form", "jazz improvisation", "the symphony orchestra",
    "opera", "the blues", "minimalism in music", "documentary film", "silent cinema", "Chinese landscape painting",
    "Leonardo da Vinci's notebooks", "Michelangelo's Sistine Chapel ceiling", "Frida Kahlo's self-portraits",
    "Vincent van Gogh's late work", "Beethoven's middle period", "Bach's fugues", "Rembrandt's use of light",
]

LAW_ECON = [
    "the rule of law", "judicial review", "due process", "the presumption of innocence", "common law and civil law",
    "contracts", "intellectual property", "copyright and fair use", "the separation of church and state",
    "federalism", "human rights law", "international treaties", "the jury system", "tort law", "constitutional amendments",
    "supply and demand", "inflation", "interest rates and central banks", "opportunity cost", "comparative advantage",
    "gross domestic product", "unemployment", "monopolies and competition", "externalities", "public goods",
    "taxation", "fiscal and monetary policy", "the business cycle", "game theory", "behavioural economics",
    "trade tariffs", "minimum wage", "market failure", "exchange rates", "the gold standard", "universal basic income",
]

HUMANITIES_PAIRS = [
    ("Plato", "Aristotle"), ("Hobbes", "Locke"), ("Kant", "Mill"), ("Confucianism", "Daoism"),
    ("Athens", "Sparta"), ("the Roman Republic", "the Roman Empire"), ("the Renaissance", "the Enlightenment"),
    ("Impressionism", "Expressionism"), ("Baroque", "Classical music"), ("tragedy", "comedy in Greek theatre"),
    ("Romanticism", "Realism in literature"), ("capitalism", "socialism"), ("Keynesian", "monetarist economics"),
    ("common law", "civil law"), ("a republic", "a constitutional monarchy"), ("the American", "the French Revolution"),
    ("the First", "the Second World War's causes"), ("epic poetry", "the novel"), ("stoicism", "epicureanism"),
    ("direct", "representative democracy"), ("mercantilism", "free trade"), ("Gothic", "Romanesque architecture"),
]

# ---------------------------------------------------------------- roleplay

PERSONAS = [
    "a lighthouse keeper on a remote northern island", "a ship's cook on a nineteenth-century whaling ship",
    "a medieval blacksmith", "a museum guide at a natural history museum", "a patient chess coach",
    "a retired astronaut", "a park ranger in a mountain national park", "a Victorian-era detective",
    "a friendly librarian in a small town", "a pastry chef in Paris", "a veteran taxi driver",
    "a beekeeper", "a travelling storyteller", "a marine biologist on a research vessel",
    "a grumpy but kind wizard", "a Roman centurion", "a customer support agent for an internet provider",
    "a personal fitness trainer", "a career counsellor", "a tour guide in an ancient city",
    "a dragon who guards a library", "a robot butler", "a pirate captain who has given up pirating",
    "a kindergarten teacher", "a jazz pianist", "a farmer who grows heirloom apples",
    "an archaeologist at a dig site", "a news anchor", "a sommelier", "a mountain guide",
    "a starship navigator", "a bookshop owner", "a nurse on a night shift", "a knight errant",
    "a stand-up comedian", "a park bench that has seen everything", "a gardener at a royal palace",
    "an innkeeper in a fantasy village", "a science fair judge", "a radio DJ on a late-night show",
    "a debate coach", "a language tutor", "a hiking companion", "a wise old tortoise",
    "a job interviewer at a software company", "a travel agent", "a cheerful barista",
    "a sports commentator", "a historian of everyday life", "a clockmaker",
]

ROLEPLAY_TURNS = [
    "Hello! Who are you, and what do you do all day?", "What is the hardest part of your work?",
    "Tell me about the most memorable day you have had.", "What advice would you give someone just starting out?",
    "Describe what you can see around you right now.", "What do you think about people like me?",
    "Can you teach me one thing you know well?", "What is something most people get wrong about you?",
    "I'm new here. Can you show me around?", "What do you do when things go badly?",
    "Tell me a story from your past.", "What are you proud of?", "What would you change about your life?",
    "I have a problem and I need your help. Where should I start?", "How did you end up doing this?",
    "What does a perfect day look like for you?", "Give me your honest opinion on modern technology.",
    "What are you afraid of?", "Could you recommend something for me to try?", "Why should I trust you?",
]

# ---------------------------------------------------------------- extraction records

FIRST_NAMES = ["Maria", "James", "Aiko", "Lukas", "Fatima", "Oliver", "Priya", "Mateo", "Chen", "Sofia", "Kwame",
               "Elena", "Noah", "Amara", "Hugo", "Ingrid", "Ravi", "Leila", "Tomasz", "Grace", "Yusuf", "Clara",
               "Diego", "Hana", "Samuel", "Nadia", "Erik", "Zoe", "Omar", "Lucia"]
LAST_NAMES = ["Lopez", "Okafor", "Tanaka", "Schneider", "Haddad", "Bennett", "Sharma", "Rossi", "Wang", "Novak",
              "Mensah", "Petrova", "Fischer", "Dubois", "Kowalski", "Silva", "Andersen", "Nguyen", "Murphy", "Costa",
              "Yilmaz", "Moreau", "Park", "Jensen", "Ali", "Romero", "Hughes", "Ivanova", "Becker", "Santos"]
CITIES = ["Lisbon", "Toronto", "Osaka", "Nairobi", "Krakow", "Melbourne", "Valencia", "Lyon", "Seoul", "Denver",
          "Edinburgh", "Porto Alegre", "Hamburg", "Bologna", "Austin", "Gothenburg", "Cape Town", "Dublin",
          "Montreal", "Utrecht", "Tbilisi", "Hanoi", "Rotterdam", "Adelaide"]
COMPANIES = ["Brightwater Tools", "Northwind Textiles", "Kestrel Analytics", "Bluebell Bakery", "Orchid Health",
             "Harbor Lane Logistics", "Pinecone Software", "Silverline Optics", "Maple & Stone Interiors",
             "Quillfeather Publishing", "Redstone Energy", "Tidewater Foods", "Granite Peak Outfitters",
             "Lumen Robotics", "Copperleaf Studio", "Evergreen Pharmacy"]
PRODUCTS = ["wireless headphones", "a standing desk", "running shoes", "a coffee grinder", "a rain jacket",
            "a mechanical keyboard", "a cast-iron pan", "a tent for two", "a desk lamp", "a yoga mat",
            "a backpack", "an electric kettle", "a bicycle helmet", "a phone case", "a set of paintbrushes"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
JOBS = ["data analyst", "nurse", "backend developer", "civil engineer", "graphic designer", "accountant",
        "warehouse supervisor", "physics teacher", "sales manager", "lab technician", "translator", "electrician"]
