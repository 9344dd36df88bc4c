"""Prompt sets no calibration, training or tuning data contains: written for this project, or taken from
public-domain books, so that speed is measured on text nothing was tuned on.

* ``code-requests``: chat-style requests for code ("write a function that ..."), answered in prose and
  code, unlike HumanEval's completions of a given signature;
* ``passages``: the openings of public-domain novels, continued as plain text (no chat template); they
  are full of names and rare words, and they repeat themselves, as old prose does.

Neither set is drawn by ``hispec-selfdistill``, ``hispec-tune`` or the calibration traces (whose prompts
come from ShareGPT, HumanEval and the built-in chat prompts).
"""

from __future__ import annotations

CODE_REQUESTS: tuple[str, ...] = (
    "Write a Python function that checks whether a string is a valid IPv4 address, and explain the edge cases.",
    "Write a function that merges two sorted lists into one sorted list without using sort(). Explain how it works.",
    "I need a small Python class for a bank account with deposit, withdraw and a balance that can never go "
    "negative. Write it with a short usage example.",
    "Write a function that returns the n-th Fibonacci number in O(log n) time, and say why it is that fast.",
    "Write a Python script that counts how often each word appears in a text file and prints the ten most "
    "common words.",
    "Write a function that converts a Roman numeral such as 'MCMXCIV' to an integer, with a few tests.",
    "Can you write a JavaScript function that debounces another function? Explain when I would use it.",
    "Write a SQL query that finds, for each department, the employee with the highest salary. Explain the "
    "query step by step.",
    "Write a function that flattens an arbitrarily nested list of integers in Python, iteratively rather than "
    "recursively.",
    "Write a Python decorator that retries a function up to three times when it raises an exception, waiting a "
    "second between tries.",
    "Write a function that checks whether a string of brackets like '([]{})' is balanced, and explain the idea.",
    "Write a bash script that renames every .jpeg file in a folder to .jpg, and explain each line.",
    "Write a Python function that groups a list of words into anagram groups, and give its running time.",
    "Write a simple LRU cache class in Python with get and put in O(1) time. Explain the data structures.",
    "Write a function that parses a date string like '2024-03-15' without any library and returns the day "
    "of the week.",
    "Write a Rust function that reverses the words of a sentence in place, and explain the ownership rules "
    "involved.",
    "Write a Python generator that yields prime numbers forever, and show how to take the first twenty.",
    "Write a function that computes the Levenshtein distance between two strings, with a short explanation.",
    "Write a Python function that validates a password: at least 12 characters, one digit, one upper-case "
    "letter and one symbol. Return the reasons it fails.",
    "Write a binary search function in C that returns the index of a value in a sorted array or -1, and "
    "explain how it avoids overflow.",
    "Write a function that transposes a matrix given as a list of lists, without numpy, and test it.",
    "Write a Python function that reads a CSV file of expenses and returns the total per category, using only "
    "the standard library.",
    "Write a function that formats a number of seconds as a human-readable duration like '2 h 5 min 3 s'.",
    "Write a TypeScript interface for a blog post and a function that sorts posts by date, newest first.",
)

PASSAGES: tuple[str, ...] = (
    # Jane Austen, Pride and Prejudice (1813)
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, must be in want "
    "of a wife. However little known the feelings or views of such a man may be on his first entering a "
    "neighbourhood, this truth is so well fixed in the minds of the surrounding families, that he is considered "
    "the rightful property of some one or other of their daughters. \"My dear Mr. Bennet,\" said his lady to him "
    "one day, \"have you heard that Netherfield Park is let at last?\"",
    # Leo Tolstoy, War and Peace (1869; Maude translation)
    "\"Well, Prince, so Genoa and Lucca are now just family estates of the Buonapartes. But I warn you, if you "
    "don't tell me that this means war, if you still try to defend the infamies and horrors perpetrated by that "
    "Antichrist--I really believe he is Antichrist--I will have nothing more to do with you.\" It was in July, "
    "1805, and the speaker was the well-known Anna Pavlovna Scherer, maid of honor and favorite of the Empress "
    "Marya Fedorovna.",
    # Herman Melville, Moby-Dick (1851)
    "Call me Ishmael. Some years ago--never mind how long precisely--having little or no money in my purse, and "
    "nothing particular to interest me on shore, I thought I would sail about a little and see the watery part "
    "of the world. It is a way I have of driving off the spleen and regulating the circulation. Whenever I find "
    "myself growing grim about the mouth; whenever it is a damp, drizzly November in my soul;",
    # Charles Dickens, A Tale of Two Cities (1859)
    "It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of "
    "foolishness, it was the epoch of belief, it was the epoch of incredulity, it was the season of Light, it "
    "was the season of Darkness, it was the spring of hope, it was the winter of despair,",
    # Fyodor Dostoevsky, The Brothers Karamazov (1880; Garnett translation)
    "Alexey Fyodorovitch Karamazov was the third son of Fyodor Pavlovitch Karamazov, a land owner well known in "
    "our district in his own day, and still remembered among us owing to his gloomy and tragic death, which "
    "happened thirteen years ago, and which I shall describe in its proper place. For the present I will only "
    "say that this \"landowner\"--for so we used to call him, although he hardly spent a day of his life on his "
    "own estate--was a strange type,",
    # Arthur Conan Doyle, A Scandal in Bohemia (1891)
    "To Sherlock Holmes she is always the woman. I have seldom heard him mention her under any other name. In "
    "his eyes she eclipses and predominates the whole of her sex. It was not that he felt any emotion akin to "
    "love for Irene Adler. All emotions, and that one particularly, were abhorrent to his cold, precise but "
    "admirably balanced mind.",
    # Lewis Carroll, Alice's Adventures in Wonderland (1865)
    "Alice was beginning to get very tired of sitting by her sister on the bank, and of having nothing to do: "
    "once or twice she had peeped into the book her sister was reading, but it had no pictures or "
    "conversations in it, \"and what is the use of a book,\" thought Alice \"without pictures or "
    "conversations?\" So she was considering in her own mind",
    # Bram Stoker, Dracula (1897)
    "3 May. Bistritz.--Left Munich at 8:35 P.M., on 1st May, arriving at Vienna early next morning; should have "
    "arrived at 6:46, but train was an hour late. Buda-Pesth seems a wonderful place, from the glimpse which I "
    "got of it from the train and the little I could walk through the streets. I feared to go very far from "
    "the station, as we had arrived late and would start as near the correct time as possible.",
    # Mary Shelley, Frankenstein (1818)
    "You will rejoice to hear that no disaster has accompanied the commencement of an enterprise which you have "
    "regarded with such evil forebodings. I arrived here yesterday, and my first task is to assure my dear "
    "sister of my welfare and increasing confidence in the success of my undertaking. I am already far north "
    "of London, and as I walk in the streets of Petersburgh,",
    # Gustave Flaubert, Madame Bovary (1857; Marx-Aveling translation)
    "We were in class when the head-master came in, followed by a \"new fellow,\" not wearing the school "
    "uniform, and a school servant carrying a large desk. Those who had been asleep woke up, and every one "
    "rose as if just surprised at his work. The head-master made a sign to us to sit down. Then, turning to "
    "the class-master, he said to him in a low voice--\"Monsieur Roger, here is a pupil whom I recommend to "
    "your care;",
    # Victor Hugo, Les Miserables (1862; Hapgood translation)
    "In 1815, M. Charles-Francois-Bienvenu Myriel was Bishop of D---- He was an old man of about seventy-five "
    "years of age; he had occupied the see of D---- since 1806. Although this detail has no connection "
    "whatever with the real substance of what we are about to relate, it will not be superfluous, if merely "
    "for the sake of exactness in all points, to mention here the various rumors and remarks which had been in "
    "circulation about him",
    # Homer, The Odyssey (Butler translation, 1900)
    "Tell me, O Muse, of that ingenious hero who travelled far and wide after he had sacked the famous town of "
    "Troy. Many cities did he visit, and many were the nations with whose manners and customs he was "
    "acquainted; moreover he suffered much by sea while trying to save his own life and bring his men safely "
    "home; but do what he might he could not save his men,",
)
