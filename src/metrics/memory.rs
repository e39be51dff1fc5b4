//! The process's memory: the resident size /proc tells, and the heap the
//! binary's counting allocator tells. Neither is a registered family (they
//! are read when scraped), so `/metrics` appends them to the registry's text
//! here, and `kvroute bench soak` reads them too.

/// How the heap's allocated bytes are read: the binary's counting global
/// allocator, installed by `main` (a library cannot see it). Unset in tests
/// and embedders, where the gauge is absent.
static HEAP_ALLOCATED: std::sync::OnceLock<fn() -> u64> = std::sync::OnceLock::new();

/// Installs the reader of the heap's allocated bytes (first call wins).
pub fn count_heap_with(reader: fn() -> u64) {
    let _ = HEAP_ALLOCATED.set(reader);
}

/// How freed memory is handed back to the operating system: the binary's
/// allocator keeps freed pages for reuse, which is right for the many small
/// buffers of routing but keeps the pages of a dropped index table (tens to
/// hundreds of MiB) resident for nothing. Installed by `main`; unset in
/// tests and embedders, whose allocator (the system's) returns large
/// allocations by itself.
static RETURN_FREED: std::sync::OnceLock<fn()> = std::sync::OnceLock::new();

/// Installs how freed memory is returned to the OS (first call wins).
pub fn return_freed_memory_with(release: fn()) {
    let _ = RETURN_FREED.set(release);
}

/// Returns freed memory to the OS, if the binary said how: called after
/// large structures are dropped (a worker's tables, a model's index).
pub fn return_freed_memory() {
    if let Some(release) = RETURN_FREED.get() {
        release();
    }
}

/// Heap bytes allocated and not yet freed, if the binary counts them. A leak
/// grows this; pages the allocator keeps after a burst grow only the
/// resident memory.
pub fn heap_allocated_bytes() -> Option<u64> {
    HEAP_ALLOCATED.get().map(|read| read())
}

/// This process's resident memory (VmRSS), where /proc tells it (Linux).
/// `/metrics` exports it; `kvroute bench soak` prints it and judges by it
/// only where the heap is not counted.
pub fn resident_memory_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmRSS:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    kib.checked_mul(1024)
}

/// The two gauges' text exposition, each where it can be read: the
/// resident memory under its conventional (unprefixed) name, then the heap.
pub(super) fn exposition() -> String {
    let mut text = String::new();
    if let Some(bytes) = resident_memory_bytes() {
        text.push_str(
            "# HELP process_resident_memory_bytes Resident memory size in bytes.\n\
             # TYPE process_resident_memory_bytes gauge\n",
        );
        text.push_str(&format!("process_resident_memory_bytes {bytes}\n"));
    }
    if let Some(bytes) = heap_allocated_bytes() {
        text.push_str(
            "# HELP kvroute_heap_allocated_bytes Heap bytes allocated and not yet freed \
             (resident memory also holds freed pages the allocator keeps, code and stacks).\n\
             # TYPE kvroute_heap_allocated_bytes gauge\n",
        );
        text.push_str(&format!("kvroute_heap_allocated_bytes {bytes}\n"));
    }
    text
}
