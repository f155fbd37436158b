/* being written */
typedef int ts__unit_store;
