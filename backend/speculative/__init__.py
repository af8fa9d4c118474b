"""Speculative decoding: drafts proposed for a request's next tokens (`ngram`), and the rule
that verifies them against the target model exactly (`verification`)."""
