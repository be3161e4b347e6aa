//! Extractive question answering (SQuAD v1.1/v2.0, BERT-style), the data
//! side, mirroring transformers' examples/pytorch/question-answering:
//! a BERT WordPiece tokenizer made here (`wordpiece`), run_qa.py's windowed
//! features (`features`), utils_qa.py's answer extraction from start/end
//! logits (`postprocess`) and the official v1.1/v2.0 scores (`squad_eval`).

pub mod wordpiece;
pub mod features;
pub mod postprocess;
pub mod squad_eval;
