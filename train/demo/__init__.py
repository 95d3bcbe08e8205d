"""The bundled demo models, built from the offline corpus: the corpus and its token
arrays (`corpus`, `token_corpus`, `prepare_corpus`), the tokenizer (`train_tokenizer`),
the target (`train_target`), the drafters' training prompts (`prompts`), the export into
the package (`export_bundled`) and every stage in order (`build`: ``python -m
train.demo.build``). Drafter training itself is the rest of `train`."""
