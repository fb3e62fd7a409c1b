// Shared settings for Sentinel's BPF programs (kernel side). Struct layouts that user space
// reads are declared in each program; bcc builds their ctypes twins for the loaders.
// The reserve-or-count-lost block stays written out in each program: bcc refuses map functions
// inside macros ("cannot use map function inside a macro").
#ifndef SENTINEL_EVENTS_H
#define SENTINEL_EVENTS_H

#ifndef RINGBUF_PAGES
#define RINGBUF_PAGES 64
#endif

#endif
