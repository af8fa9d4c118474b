from tests.preprocessing.tokenizer_fixtures import sentencepiece, smollm2  # noqa: F401
