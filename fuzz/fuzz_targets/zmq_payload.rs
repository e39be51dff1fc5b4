//! Fuzz target: see `kvroute::fuzzing::zmq_payload`.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| kvroute::fuzzing::zmq_payload(data));
